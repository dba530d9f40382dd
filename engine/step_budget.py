"""The step budget: what the step-time and first-token targets let into one step.

The scheduler asks it four things each step, all within a step-time target
(``engine/step_target.py``; without one every answer lets everything in):

- **how far the target stretches**: as far as the first-token deadlines still ahead need, and by
  the square of the oldest wait for a first token over the first-token target once past it
  (``begin_step``);
- **how many requests run** (``slot_limit``), and whether a waiting request is admitted past
  that limit because its tenant is served far less than one already running
  (``admits_past_limit``);
- **which decodes sit the step out** (``defer_decodes_ahead``, ``trim_decodes_ahead``): the
  decodes of tenants served more than the policy's ``decode_lead`` ahead, most served first, so
  that a less-served tenant's prompt fits in the step, or so that decodes admitted past the
  unstretched target run by weight;
- **how much prefill goes beside the decodes** (``prefill_held_back``).

Who is "served more" is the admission policy's measure (``AdmissionPolicy.service``: weighted
virtual-time counters under fair share); admission order (FIFO) has none, and there no decode
ever sits out. Pure Python, no torch.
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from collections.abc import Callable, Mapping

from engine.policy import AdmissionPolicy
from engine.request import Request, RequestStatus
from engine.step_target import StepTarget

# The most a first token overdue stretches the step-time target (then slots and the token
# budget bound the step).
MAX_STRETCH = 64.0
# The most the target stretches for first tokens not yet late. Beyond it a burst's deadlines
# would lengthen the steps that everyone's prompts, a light tenant's beside a flood included,
# wait in (their first token comes when the step ends).
PLAN_STRETCH = 4.0


class StepBudget:
    """The step-time target (``target``) and the first-token target (``ttft_target_s``) as the
    scheduler applies them; either may be None (then it bounds nothing)."""

    __slots__ = ("_awaiting_first", "clock", "target", "ttft_target_s")

    def __init__(
        self,
        target: StepTarget | None = None,
        ttft_target_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.target = target
        self.ttft_target_s = ttft_target_s
        self.clock = clock
        self._awaiting_first: deque[tuple[float, Request]] = deque()  # in arrival order

    @property
    def first_token_target(self) -> bool:
        """Whether a first-token target applies (it needs a step-time target to stretch)."""
        return self.target is not None and self.ttft_target_s is not None

    def watch(self, request: Request, arrived: float) -> None:
        """Track a new request's wait for its first token."""
        if self.first_token_target:
            self._awaiting_first.append((arrived, request))

    def begin_step(self, num_decodes: int = 0) -> None:
        """Set the step's stretch, for a step that runs ``num_decodes`` decodes."""
        if self.target is not None:
            self.target.stretch = self._stretch(num_decodes)

    def _stretch(self, num_decodes: int) -> float:
        """How far the step-time target stretches this step: as far as the first tokens planned
        to come by their deadlines (arrival plus the first-token target) need, and at least by
        the square of the oldest wait over the first-token target once it is past it.

        The plan takes the requests waiting for a first token in deadline order (arrival order:
        one target for all), after the work of those that have waited more than twice the
        target, which goes first whatever the plan. The k-th planned first token needs the
        prompt tokens left of the k before it computed by its deadline
        (``StepTarget.stretch_to_prefill``). Where a deadline cannot be met by steps stretched
        up to ``PLAN_STRETCH``, the longest prompt planned so far leaves the plan (Moore and
        Hodgson's rule: the fewest deadlines missed that one machine can reach). A request out
        of the plan, or past its deadline by less than the target, is ``first_token_late``: its
        chunks go after the planned prompts of its class (``AdmissionPolicy.prefill_key``). So
        a burst longer than the machine can take costs the fewest first tokens, and no request
        waits more than twice the target before it is first in line. O(requests waiting for a
        first token × log); the front leaves once it has a token or is gone."""
        pending = self._awaiting_first
        while pending and _has_first_token(pending[0][1]):
            pending.popleft()[1].first_token_late = False
        target, ttft = self.target, self.ttft_target_s
        if not pending or ttft is None or target is None:
            return 1.0
        now = self.clock()
        overdue = (now - pending[0][0]) / ttft
        stretch = max(1.0, overdue * overdue)
        first = 0  # prompt tokens of the requests waiting over twice the target
        planned: list[tuple[float, int, Request]] = []  # (seconds to deadline, tokens, request)
        longest: list[tuple[int, int]] = []  # planned, longest then latest first: (-tokens, -index)
        num_tokens = 0  # of the requests in the plan
        for arrived, request in pending:
            request.first_token_late = False
            if _has_first_token(request):
                continue
            left = _prompt_left(request)
            seconds = arrived + ttft - now
            if seconds < -ttft:
                first += left
                continue
            if seconds <= target.target_s:  # due within a step: past planning for
                request.first_token_late = True
                continue
            heapq.heappush(longest, (-left, -len(planned)))
            planned.append((seconds, left, request))
            num_tokens += left
            while (
                target.stretch_to_prefill(first + num_tokens, seconds, num_decodes) > PLAN_STRETCH
            ):
                tokens, index = heapq.heappop(longest)
                index = -index
                num_tokens += tokens
                due, _, dropped = planned[index]
                planned[index] = (due, 0, dropped)
                dropped.first_token_late = True  # out of the plan
                if index == len(planned) - 1:
                    break
        num_tokens = first
        for seconds, left, _ in planned:
            if left:
                num_tokens += left
                stretch = max(stretch, target.stretch_to_prefill(num_tokens, seconds, num_decodes))
        return min(stretch, MAX_STRETCH)

    def slot_limit(self, max_num_seqs: int) -> int:
        """Requests that may run at once now: the slots, or fewer while the step-time target
        holds fewer decodes."""
        if self.target is None:
            return max_num_seqs
        return min(max_num_seqs, self.target.max_decodes)

    def admits_past_limit(
        self, request: Request, policy: AdmissionPolicy, slots: Mapping[str, int]
    ) -> bool:
        """Within a first-token target, whether the waiting ``request``'s tenant is served more
        than ``policy.decode_lead`` less than a tenant with requests running: then it is
        admitted past the slot limit, and the decodes of the tenant ahead sit the steps out
        (``trim_decodes_ahead``) rather than keep the tenant behind waiting for its requests to
        end. O(running tenants)."""
        lead = policy.decode_lead
        if not self.first_token_target or lead is None or not slots:
            return False
        served = policy.service
        return served(request.tenant_id) + lead < max(served(t) for t in slots)

    def defer_decodes_ahead(
        self,
        decodes: list[Request],
        prefills: list[Request],
        pending: list[Request],
        policy: AdmissionPolicy,
    ) -> tuple[list[Request], list[Request], set[str]]:
        """The decodes that run this step, those that sit it out, and the tenants none of whose
        work runs. Within a step-time target, the decodes of tenants served far more
        (``policy.decode_lead``) than a tenant whose prompt is ``pending`` (admitted, or the
        waiting head with a free slot) sit this step out, the most-served first, until the step
        has room for that prompt (when sitting out can make it fit at all): a flood's decodes
        then do not lengthen the first token of the tenants it would crowd out, and its counter
        stands still while theirs catch up. Tenants ahead by ``policy.yield_lead`` or more sit
        out with all their work, so the prompt's step is as short as its own tenants' work
        makes it. O(running)."""
        lead = policy.decode_lead
        target = self.target
        if lead is None or target is None or not decodes or not pending:
            return decodes, [], set()
        served = policy.service
        least = min(served(r.tenant_id) for r in pending)
        threshold = least + lead
        demand = sum(r.num_remaining_tokens for r in pending if served(r.tenant_id) <= threshold)
        ahead = sorted(
            (r for r in decodes if served(r.tenant_id) > threshold),
            key=lambda r: (served(r.tenant_id), r.admitted_index),
        )
        num_kept = len(decodes)
        smallest = min(r.num_remaining_tokens for r in pending if served(r.tenant_id) <= threshold)
        if target.prefill_budget(num_kept - len(ahead)) < smallest:
            # Not even all of them sitting out would let one of these prompts end in this step
            # (long prompts): they would sit out step after step, so none does, and the prompts
            # go on at the prefill share every step has.
            return decodes, [], set()
        deferred: set[str] = set()
        sitting: set[str] = set()
        if policy.yield_lead is not None:
            far = least + policy.yield_lead
            sitting = {r.tenant_id for r in (*ahead, *prefills) if served(r.tenant_id) >= far}
            deferred = {r.request_id for r in ahead if r.tenant_id in sitting}
            num_kept -= len(deferred)
            ahead = [r for r in ahead if r.tenant_id not in sitting]
        while ahead and target.prefill_budget(num_kept) < demand:
            deferred.add(ahead.pop().request_id)
            num_kept -= 1
        if not deferred:
            return decodes, [], sitting
        kept = [r for r in decodes if r.request_id not in deferred]
        return kept, [r for r in decodes if r.request_id in deferred], sitting

    def trim_decodes_ahead(
        self, decodes: list[Request], prefills: list[Request], policy: AdmissionPolicy
    ) -> list[Request]:
        """The decodes that run when more run than the step-time target holds (requests admitted
        while a first token was overdue): the decodes of tenants served more than
        ``policy.decode_lead`` ahead of the least-served tenant with work in the step sit out,
        the most served first, until the rest fit the unstretched target. Tenants within the
        lead of each other all run: the step outgrows its target rather than anyone starving,
        and the target's room goes by weight where a queue would have ordered it.
        O(running log running)."""
        lead = policy.decode_lead
        target = self.target
        if not self.first_token_target or lead is None or target is None or not decodes:
            return decodes
        excess = len(decodes) - target.decodes_within(1.0)
        if excess <= 0:
            return decodes
        served = policy.service
        least = min(served(r.tenant_id) for r in (*decodes, *prefills))
        ahead = sorted(
            (r for r in decodes if served(r.tenant_id) > least + lead),
            key=lambda r: (served(r.tenant_id), r.admitted_index),
        )
        if not ahead:
            return decodes
        sit_out = {r.request_id for r in ahead[max(0, len(ahead) - excess) :]}
        return [r for r in decodes if r.request_id not in sit_out]

    def prefill_held_back(
        self, budget: int, num_decodes: int, num_active_tenants: Callable[[], int]
    ) -> int:
        """Of the token ``budget`` the step's decodes left, what prefill may not use. Within a
        step-time target, prefill gets what the decodes leave of the step's time. With no decode
        running, one tenant alone takes the whole budget (nobody waits on its step), but several
        tenants' prompts go in short steps, least served first, so that a flood's prompts do not
        lengthen the step that gives the others their first tokens. Decodes past the target
        (admitted for overdue first tokens) never squeeze the prompts below their share: the
        prompts are what the first-token target is for."""
        target = self.target
        if target is None or not (num_decodes or num_active_tenants() > 1):
            return 0
        room = target.prefill_budget(num_decodes)
        if self.ttft_target_s is not None:
            room = max(room, target.prefill_share())
        return max(0, budget - room)


def _has_first_token(request: Request) -> bool:
    return bool(request.output_token_ids) or request.status is RequestStatus.FINISHED


def _prompt_left(request: Request) -> int:
    """Prompt tokens still to compute for ``request``'s first token: those past what is computed,
    or, before its admission, past the prefix the cache held when it arrived."""
    done = max(request.num_computed_tokens, request.cached_on_arrival)
    return max(1, request.num_prompt_tokens - done)
