"""N-gram drafts for a step's decodes, from the prompt room the step has left."""

from __future__ import annotations

from engine.policy import AdmissionPolicy
from engine.request import RequestStatus
from engine.scheduler.output import Drafter, ScheduledSeq, SchedulerOutput
from engine.scheduler.pages import RequestPages


def add_drafts(
    out: SchedulerOutput,
    drafter: Drafter,
    max_draft_batch: int | None,
    budget: int,
    pages: RequestPages,
    policy: AdmissionPolicy,
) -> int:
    """Give the step's decodes (its first ``out.num_decodes`` sequences) drafts of at most
    ``budget`` tokens in all; none when the step holds more than ``max_draft_batch`` decodes.
    Returns the tokens the drafts took."""
    num_decodes = out.num_decodes
    if max_draft_batch is not None and num_decodes > max_draft_batch:
        return 0
    used = 0
    for i in range(num_decodes):
        if used >= budget:
            break
        request = out.seqs[i].request
        if request.status is not RequestStatus.RUNNING or request.num_output_tokens == 0:
            continue
        # The last of max_tokens is always the model's own: a draft stops one short of it.
        limit = min(request.params.max_tokens - request.num_output_tokens - 1, budget - used)
        if limit <= 0:
            continue
        draft = drafter.propose(request, limit)
        num_new = pages.num_fitting(request, 1 + len(draft))
        if num_new <= 1:
            continue
        pages.grow(request, num_new)
        out.seqs[i] = ScheduledSeq(request, num_new, True, tuple(draft[: num_new - 1]))
        policy.charge(request, num_new - 1, 0, 0)  # a row each, like prompt tokens
        used += num_new - 1
    return used
