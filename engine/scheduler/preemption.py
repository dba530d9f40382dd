"""Preemption: which running request gives up its pages or its slot.

For pages, the policy's victim among requests not yet scheduled this step (a prompt takes only
from requests admitted after it). For a slot, when every slot is taken and the next tenant in line
holds fewer than its weighted share while another holds more, one of the other's requests goes
(the policy takes none from a tenant served less). The victim's full pages stay cached.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from engine.policy import AdmissionPolicy
from engine.request import Request


def page_victim(
    policy: AdmissionPolicy,
    running: list[Request],
    scheduled: Collection[str],
    requester: Request,
) -> Request | None:
    """A running request to preempt for ``requester``'s pages. A prompt takes pages only from
    requests admitted after it: two prompts that each need most of the pages would otherwise
    take them from each other in turn and neither would ever finish (a decode moves on by a
    token each time, so it may take from any)."""
    prefill = requester.num_remaining_tokens > 1
    candidates = [
        request
        for request in running
        if request is not requester
        and request.request_id not in scheduled
        and not (prefill and request.admitted_index < requester.admitted_index)
    ]
    return policy.pick_victim(candidates)


def slot_victim(
    policy: AdmissionPolicy,
    running: list[Request],
    slots: Mapping[str, int],
    limit: int,
) -> Request | None:
    """A running request whose slot goes to the waiting head, when every one of ``limit``
    slots is taken and the head's tenant holds fewer than its weighted share. O(running)."""
    if len(running) < limit:
        return None
    head = policy.peek()
    if head is None:
        return None
    weights: dict[str, float] = {head.tenant_id: head.tenant_weight}
    for request in running:
        weights[request.tenant_id] = request.tenant_weight
    total = sum(max(w, 1e-9) for w in weights.values())

    def fair(tenant_id: str) -> float:
        return limit * max(weights[tenant_id], 1e-9) / total

    if slots.get(head.tenant_id, 0) + 1 > fair(head.tenant_id):
        return None
    over = [r for r in running if slots[r.tenant_id] - 1 >= fair(r.tenant_id)]
    return policy.pick_victim(over, beneficiary=head)
