"""The scheduler: each step, running decodes first, then prompt chunks and admissions.

One policy (ARCHITECTURE.md, step 8): the queue's order is weighted virtual counters with
first-token deadlines (``engine/fair_share.py``); the step budget (``budget.py``) gives prompts
the room the TPOT target leaves beside the decodes, and a prompt whose deadline is due the whole
token budget and a slot beyond the TPOT target's decode limit. Background work (Batch API lines)
sits out the steps of a foreground prompt. Pure Python (no torch).
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable

from engine.policy import AdmissionPolicy
from engine.request import Request, RequestStatus
from engine.scheduler import admission, preemption
from engine.scheduler.budget import StepBudget
from engine.scheduler.drafts import add_drafts
from engine.scheduler.output import Drafter, SchedulerOutput
from engine.scheduler.running import RunningSet
from radix_cache.prefix_cache import PrefixCache


class Scheduler(RunningSet):
    """Each step's schedule over the running set and the policy's queue."""

    def __init__(
        self,
        cache: PrefixCache,
        policy: AdmissionPolicy,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        drafter: Drafter | None = None,
        max_draft_batch: int | None = None,
        budget: StepBudget | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_num_seqs > max_num_batched_tokens:
            raise ValueError("max_num_seqs must not exceed max_num_batched_tokens")
        super().__init__(cache, policy, max_num_seqs, budget, clock)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.drafter = drafter
        self.max_draft_batch = max_draft_batch  # steps with more decodes run no drafts
        self._now = 0.0
        self._decode_counters: list[float] = []  # the step's decodes' tenant counters, sorted
        self._prefill_start = 0  # the token budget left once the step's decodes were scheduled

    @property
    def slot_limit(self) -> int:
        """Requests that may run at once unless one is due: the TPOT target's decodes."""
        return self.budget.max_decodes(self.max_num_seqs)

    # -- schedule -------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self._now = self.clock()
        decodes = [r for r in self.running if r.num_remaining_tokens == 1]
        self.policy.begin_step(self._now, lambda n: self._horizon(n, len(decodes)))
        victim = preemption.slot_victim(self.policy, self.running, self.slots, self.max_num_seqs)
        if victim is not None and self.cache.shares_pages:
            self._preempt(victim, out)
            decodes = [r for r in decodes if r is not victim]
        prefills = sorted(
            (r for r in self.running if r.num_remaining_tokens > 1), key=self.policy.service_key
        )
        # Background work sits out while a foreground prompt can run (it may after all, below).
        foreground_only = self._foreground_pending(prefills)
        held = [r for r in self.running if r.background] if foreground_only else []
        scheduled: set[str] = set()
        budget = self.max_num_batched_tokens
        for request in decodes:
            if request not in held:
                budget = self._run(request, budget, budget, out, scheduled)
        out.num_decodes = len(out.seqs)
        self._decode_counters = sorted(self.policy.counter(s.request.tenant_id) for s in out.seqs)
        self._prefill_start = budget
        num_preempted = len(out.preempted)
        for request in prefills:
            if request in held:
                continue
            if len(out.preempted) == num_preempted:  # waiting work served before this chunk
                budget = self._admit(out, budget, scheduled, foreground_only, request)
            due = self._running_due(request, out.num_decodes)
            allowed = budget if due else self._room(request.tenant_id, budget)
            budget = self._run(request, allowed, budget, out, scheduled)
        if len(out.preempted) == num_preempted:  # no memory pressure this step
            budget = self._admit(out, budget, scheduled, foreground_only)
        if held and len(out.seqs) == out.num_decodes:  # the foreground prompt could not run
            budget = self._run_held(held, out, budget, scheduled)
            self._decode_counters = []
            budget = self._admit(out, budget, scheduled)
        if self.drafter is not None:
            room = min(budget, self._room(None, budget))
            budget -= add_drafts(
                out, self.drafter, self.max_draft_batch, room, self.pages, self.policy
            )
        out.num_batched_tokens = sum(seq.num_new_tokens for seq in out.seqs)
        return out

    def _room(self, tenant_id: str | None, budget: int) -> int:
        """Prompt tokens a tenant's work may still take this step within the TPOT target: what
        the decodes of tenants served no more than it leave (the decodes of tenants served more
        do not shorten its room: they pay for their own load), less the prompt tokens already
        scheduled. ``None``: what all the decodes leave. With no decode in the step, no time
        per output token is at stake: the whole budget."""
        counters = self._decode_counters
        if not counters:
            return budget
        if tenant_id is None:
            num_decodes = len(counters)
        else:
            num_decodes = bisect.bisect_right(counters, self.policy.counter(tenant_id))
        room = self.budget.prefill_room(num_decodes, self.max_num_batched_tokens)
        return max(0, min(budget, room - (self._prefill_start - budget)))

    def _horizon(self, num_tokens: int, num_decodes: int) -> float:
        return self.budget.horizon_s(num_tokens, num_decodes, self.max_num_batched_tokens)

    def _running_due(self, request: Request, num_decodes: int) -> bool:
        """Whether an admitted prompt must take more than the TPOT room to meet its deadline."""
        need = self._horizon(request.num_remaining_tokens, num_decodes)
        return request.deadline_s - need <= self._now

    def _foreground_pending(self, prefills: list[Request]) -> bool:
        """Background work runs, and a foreground prompt is admitted or heads the queue with a
        slot free for it."""
        if not any(r.background for r in self.running):
            return False
        pending = [r for r in prefills if not r.background]
        if not pending and len(self.running) < self.slot_limit:
            head = self.policy.peek()
            return head is not None and not head.background
        return bool(pending)

    def _run_held(
        self, held: list[Request], out: SchedulerOutput, budget: int, scheduled: set[str]
    ) -> int:
        """Run the background work that sat out for a foreground prompt that could not run
        after all: decodes ahead of the step's other sequences, then prompt chunks."""
        late = SchedulerOutput()
        for request in held:
            if request.is_decoding:
                budget = self._run(request, budget, budget, late, scheduled)
        out.seqs[:0] = late.seqs
        out.preempted.extend(late.preempted)
        out.finished.extend(late.finished)
        out.num_decodes += len(late.seqs)
        for request in held:
            if not request.is_decoding:
                budget = self._run(request, budget, budget, out, scheduled)
        return budget

    def _reserve(self) -> int:
        """The free-memory bound on a prompt chunk: pages the running decodes need next step
        (each one whose last page is full) stay free."""
        size = self.page_size
        return sum(1 for r in self.running if r.is_decoding and r.num_tokens % size == 0)

    def _run(
        self, request: Request, allowed: int, budget: int, out: SchedulerOutput, scheduled: set[str]
    ) -> int:
        """Schedule up to ``allowed`` of a running request's next tokens (preempting for pages
        if it must); returns ``budget`` less what it took."""
        if request.status is not RequestStatus.RUNNING or allowed <= 0:
            return budget
        want = min(request.num_remaining_tokens, allowed)
        num_new = self.pages.num_fitting(request, want)
        while num_new == 0:
            victim = preemption.page_victim(self.policy, self.running, scheduled, request)
            if victim is None:
                break
            self._preempt(victim, out)
            num_new = self.pages.num_fitting(request, want)
        if num_new == 0:
            if len(self.running) == 1:
                # Alone and still out of room: the sequence outgrew the whole KV cache.
                self.finish(request, "length")
                out.finished.append(request)
            elif request.is_decoding:
                self._preempt(request, out)
            return budget  # a prefill chunk waits for pages instead
        if not request.is_decoding:
            num_new = min(num_new, max(1, self.pages.num_fitting(request, want, self._reserve())))
        is_decode = request.is_decoding and request.num_output_tokens > 0
        self._add_seq(out, request, num_new, scheduled)
        if is_decode:
            self.policy.charge(request, 0, 0, 1)
        else:
            self.policy.charge(request, num_new, 0, 0)
        return budget - num_new

    def _admit(
        self,
        out: SchedulerOutput,
        budget: int,
        scheduled: set[str],
        foreground_only: bool = False,
        before: Request | None = None,
    ) -> int:
        """Admit waiting requests in the policy's order while the budget and slots last: a
        request that is due takes any of the token budget and any of ``max_num_seqs``, others
        the TPOT room and slot limit. With ``before`` (a running prompt), only those the policy
        puts ahead of it. Returns the budget left."""
        deferred: list[Request] = []
        skip: set[str] = set()
        while budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.policy.peek(skip)
            if request is None:
                break
            if foreground_only and request.background:
                skip.add(request.tenant_id)
                continue
            if before is not None and not self._comes_before(request, before):
                break
            due = self.policy.is_due(request)
            room = budget if due else self._room(request.tenant_id, budget)
            if room <= 0 or (not due and len(self.running) >= self.slot_limit):
                break
            if not admission.acquire_adapter(self.lora_slots, request):
                deferred.append(self.policy.pop(skip))
                continue
            num_matched = admission.lock_prefix(self.cache, request)
            if admission.follows_inflight_prefill(self.cache, self.running, request, num_matched):
                # Its prefix is being computed right now: it reuses it in a later step, and the
                # requests behind it (other prefixes) are not held up meanwhile.
                admission.unlock_prefix(self.cache, request)
                admission.release_adapter(self.lora_slots, request)
                deferred.append(self.policy.pop(skip))
                continue
            want = min(request.num_remaining_tokens, room)
            num_new = min(want, self.pages.num_fitting(request, want, self._reserve()))
            if num_new == 0:
                admission.unlock_prefix(self.cache, request)
                admission.release_adapter(self.lora_slots, request)
                break
            self.policy.pop(skip)
            first_admission = request.num_cached_tokens < 0
            self._start(request, num_matched)
            self._add_seq(out, request, num_new, scheduled)
            budget -= num_new
            num_cached = request.num_cached_tokens if first_admission else 0
            self.policy.charge(request, num_new, num_cached, 0)
        for request in reversed(deferred):
            self.policy.defer(request)
        return budget

    def _comes_before(self, waiting: Request, running: Request) -> bool:
        key = self.policy.service_key
        return key(waiting) < key(running)
