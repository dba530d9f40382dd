"""Preemption: which running request gives way, for a slot or for pages.

Two reasons, one choice each (the scheduler carries it out: the victim's computed full pages stay
cached, the rest are freed, and it goes back to the head of its tenant's queue):

- **a slot for fairness** (``slot_victim``): every slot is taken and the next tenant in line
  holds fewer than its weighted share of them while another holds more; at most one a step, so
  the newcomer does not wait for long generations to end;
- **pages** (``page_victim``): a sequence needs a page and none is free.

The admission policy picks among the candidates (``AdmissionPolicy.pick_victim``: the most
recent admission, or under fair share the most-served tenant's). Pure Python, no torch.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from engine.policy import AdmissionPolicy
from engine.request import Request


def slot_victim(
    running: Sequence[Request],
    slots: Mapping[str, int],
    head: Request,
    limit: int,
    policy: AdmissionPolicy,
) -> Request | None:
    """The running request to preempt so that ``head`` (the next waiting request) gets one of
    the ``limit`` slots, all taken: only when its tenant holds fewer than its weighted share of
    them and another tenant more (chosen by the policy, which takes none from a tenant served
    less than the next one); else None. O(running)."""
    weights: dict[str, float] = {head.tenant_id: head.tenant_weight}
    for request in running:
        weights[request.tenant_id] = request.tenant_weight
    total_weight = sum(max(w, 1e-9) for w in weights.values())

    def fair(tenant_id: str) -> float:
        return limit * max(weights[tenant_id], 1e-9) / total_weight

    if slots.get(head.tenant_id, 0) + 1 > fair(head.tenant_id):
        return None
    over = [r for r in running if slots[r.tenant_id] - 1 >= fair(r.tenant_id)]
    return policy.pick_victim(over, beneficiary=head)


def page_victim(
    running: Sequence[Request],
    scheduled: Collection[str],
    requester: Request,
    policy: AdmissionPolicy,
) -> Request | None:
    """A running request not yet ``scheduled`` this step to preempt for ``requester``'s pages.
    A prompt takes pages only from requests admitted after it: two prompts that each need most
    of the pages would otherwise take them from each other in turn and neither would ever finish
    (a decode moves on by a token each time, so it may take from any). O(running)."""
    prefill = requester.num_remaining_tokens > 1
    candidates = [
        request
        for request in running
        if request is not requester
        and request.request_id not in scheduled
        and not (prefill and request.admitted_index < requester.admitted_index)
    ]
    return policy.pick_victim(candidates)
