"""The step scheduler: decodes first, then prefill chunks and admissions, under a token budget.

Each step runs the running decodes (a token each), then unfinished prefill chunks in the
admission policy's service order, then new requests from the policy's queue (``engine/policy.py``;
weighted fair share in ``engine/fair_share.py``), within the step's token budget, the free pages
and the slots. A waiting request that comes before a chunk in that order (a less-served tenant's,
under fair share) is admitted ahead of it. Without a step-time target the policy may cap what a
tenant's prefill takes of a step (``prefill_caps``). With one, ``engine/step_budget.py`` decides
how many requests run, which decodes sit the step out and how much prefill goes beside the
rest; ``engine/preemption.py`` picks who gives way for a slot or for pages. Background work
(Batch API lines) sits out the steps of a foreground prompt.

Pure Python (no torch). Pages come from a ``PrefixCache``; a request's block table holds its
locked cached prefix first, then its private pages. Under memory pressure chunks shrink; a decode
that cannot get a page preempts a running request.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple, Protocol

import structlog

from engine.policy import AdmissionPolicy
from engine.preemption import page_victim, slot_victim
from engine.request import Request, RequestStatus
from engine.step_budget import StepBudget
from engine.step_target import StepTarget
from radix_cache.prefix_cache import PrefixCache

if TYPE_CHECKING:
    from engine.lora.slots import AdapterSlots

log = structlog.get_logger(__name__)


class ScheduledSeq(NamedTuple):
    request: Request
    num_new_tokens: int  # tokens run this step: all_token_ids[num_computed:], then the draft
    sample: bool  # the chunk reaches the end of the sequence: its last logits give a token
    draft: tuple[int, ...] = ()  # a decode's guessed next tokens, checked by this step's logits


class Drafter(Protocol):
    def propose(self, request: Request, limit: int) -> list[int]:
        """Up to ``limit`` guessed tokens to follow a decoding request's tokens."""


@dataclass(slots=True)
class SchedulerOutput:
    seqs: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)  # ended for lack of KV capacity
    num_batched_tokens: int = 0
    num_decodes: int = 0  # of the sequences, decodes (the rest of the tokens are prefill/drafts)

    @property
    def is_empty(self) -> bool:
        return not self.seqs


class Scheduler:
    """Owns the running set; the admission policy owns the waiting queue."""

    def __init__(
        self,
        cache: PrefixCache,
        policy: AdmissionPolicy,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        drafter: Drafter | None = None,
        max_draft_batch: int | None = None,
        target: StepTarget | None = None,
        ttft_target_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_num_seqs > max_num_batched_tokens:
            raise ValueError("max_num_seqs must not exceed max_num_batched_tokens")
        self.cache = cache
        self.policy = policy
        self.page_size = cache.page_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.drafter = drafter
        self.max_draft_batch = max_draft_batch  # steps with more decodes run no drafts
        # The step-time target and the first-token target, as they bound each step.
        self.budget = StepBudget(target, ttft_target_s, clock)
        self.running: list[Request] = []  # in order of admission
        self.slots: dict[str, int] = {}  # running requests per tenant
        policy.bind_running(self.slots, max_num_seqs)
        self._slot_limit = max_num_seqs  # this step's ``slot_limit``
        # Resident LoRA adapters (engine/lora/): a request runs only while its adapter holds a
        # slot; one whose adapter finds every slot pinned waits, and the others go ahead.
        self.lora_slots: AdapterSlots | None = None
        self._num_admissions = 0

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def target(self) -> StepTarget | None:
        """The step-time bound on running requests and prefill, if any."""
        return self.budget.target

    @target.setter
    def target(self, target: StepTarget | None) -> None:
        self.budget.target = target

    @property
    def ttft_target_s(self) -> float | None:
        """The first-token target: a first token overdue stretches the step-time target."""
        return self.budget.ttft_target_s

    @ttft_target_s.setter
    def ttft_target_s(self, seconds: float | None) -> None:
        self.budget.ttft_target_s = seconds

    @property
    def clock(self) -> Callable[[], float]:
        """Seconds, for waits (monotonic; tests drive a virtual one)."""
        return self.budget.clock

    @clock.setter
    def clock(self, clock: Callable[[], float]) -> None:
        self.budget.clock = clock

    @property
    def slot_limit(self) -> int:
        """Requests that may run at once now: the slots, or fewer while the step-time target
        holds fewer decodes."""
        return self.budget.slot_limit(self.max_num_seqs)

    @property
    def num_waiting(self) -> int:
        return len(self.policy)

    def queue_wait_by_tenant(self) -> dict[str, float]:
        """Seconds each tenant's longest-waiting request has waited (since it arrived, or since
        it was preempted); O(waiting), for snapshots, not steps."""
        now = self.clock()
        waits: dict[str, float] = {}
        for request in self.policy.waiting():
            wait = max(0.0, now - request.queued_at)
            if wait > waits.get(request.tenant_id, -1.0):
                waits[request.tenant_id] = wait
        return waits

    @property
    def has_unfinished(self) -> bool:
        return bool(self.running) or len(self.policy) > 0

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        # Its wait and its first-token deadline count from when the caller accepted it: a
        # request that came during a long step has already waited that long.
        now = self.clock()
        arrived = now if request.arrived_at is None else min(now, request.arrived_at)
        request.arrived_at = request.queued_at = arrived
        self.policy.add(request)
        self.budget.watch(request, arrived)

    # -- schedule -------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled: set[str] = set()
        step_budget = self.budget
        step_budget.begin_step(sum(r.num_remaining_tokens == 1 for r in self.running))
        self._slot_limit = self.slot_limit
        self.policy.begin_step()
        self._free_slot_for_fairness(out)
        num_fair_preemptions = len(out.preempted)
        decodes = [r for r in self.running if r.num_remaining_tokens == 1]
        # Unfinished prefills in the policy's order (the sort is stable: admission order among
        # equals).
        prefills = sorted(
            (r for r in self.running if r.num_remaining_tokens > 1), key=self.policy.prefill_key
        )
        decodes, deferred, foreground_only = self._yield_background(decodes, prefills)
        # Beside a foreground prompt, background prompts sit out as well (they keep their pages).
        held = [r for r in prefills if r.background] if foreground_only else []
        if held:
            prefills = [r for r in prefills if not r.background]
        defers = bool(decodes) and self.target is not None and self.policy.decode_lead is not None
        pending = self._pending_prompts(prefills) if defers else []
        decodes, ahead, sitting = step_budget.defer_decodes_ahead(
            decodes, prefills, pending, self.policy
        )
        deferred += ahead
        if sitting:  # tenants far ahead: none of their work runs this step
            held += [r for r in prefills if r.tenant_id in sitting]
            prefills = [r for r in prefills if r.tenant_id not in sitting]
        decodes = step_budget.trim_decodes_ahead(decodes, prefills, self.policy)
        for request in decodes:
            budget = self._run(request, budget, out, scheduled)
        num_decodes = out.num_decodes = len(out.seqs)
        held_back = step_budget.prefill_held_back(budget, num_decodes, self._num_active_tenants)
        budget -= held_back
        # Tenants served ahead of others take at most their share of the prefill budget (that
        # keeps steps short; within a step-time target they are short already, and capping a
        # small budget by weight would leave a light tenant's admitted prompts a few tokens a
        # step while they hold their slots; while background work yields, its tenants would
        # count as active and cap the foreground prompt that it yields to).
        capped = self.target is None and not foreground_only
        caps = self.policy.prefill_caps(budget) if capped else None
        for request in prefills:
            if budget == 0:
                break
            if len(out.preempted) == num_fair_preemptions:
                # A waiting request of a less-served tenant is admitted before this chunk runs.
                budget = self._admit(
                    out, budget, scheduled, caps, request, foreground_only, sitting
                )
            allowed = _allowed(budget, caps, request.tenant_id)
            used = allowed - self._run(request, allowed, out, scheduled)
            _spend(caps, request.tenant_id, used)
            budget -= used
        if len(out.preempted) == num_fair_preemptions:  # no memory pressure this step
            budget = self._admit(out, budget, scheduled, caps, None, foreground_only, sitting)
        if (deferred or foreground_only or sitting) and len(out.seqs) == num_decodes:
            # The prompt they sat out for could not run (no pages, no slot): they run after all,
            # and so do the background prompts (they may hold the pages it waits for).
            budget, num_decodes = self._run_late_decodes(
                deferred, out, budget + held_back, scheduled
            )
            held_back = 0
            for request in held:
                budget = self._run(request, budget, out, scheduled)
            if (foreground_only or sitting) and len(out.preempted) == num_fair_preemptions:
                budget = self._admit(out, budget, scheduled)
        if self.drafter is not None and budget > 0:
            budget = self._add_drafts(out, num_decodes, budget)
        out.num_batched_tokens = self.max_num_batched_tokens - budget - held_back
        return out

    def _pending_prompts(self, prefills: list[Request]) -> list[Request]:
        """The prompts this step may run: the admitted ones, and the waiting head if a slot
        is free for it."""
        pending = list(prefills)
        if len(self.running) < self._slot_limit:
            head = self.policy.peek()
            if head is not None:
                pending.append(head)
        return pending

    def _yield_background(
        self, decodes: list[Request], prefills: list[Request]
    ) -> tuple[list[Request], list[Request], bool]:
        """The decodes that run this step, the background ones (Batch API lines) that sit it out
        because a foreground prompt is waiting or being prefilled, and whether background work
        yields this step (its prompts and admissions wait too): that prompt's steps are then as
        short as if the background work were not there. O(running)."""
        if not any(r.background for r in self.running):
            return decodes, [], False
        if all(r.background for r in self._pending_prompts(prefills)):
            return decodes, [], False
        kept = [r for r in decodes if not r.background]
        return kept, [r for r in decodes if r.background], True

    def _run_late_decodes(
        self, deferred: list[Request], out: SchedulerOutput, budget: int, scheduled: set[str]
    ) -> tuple[int, int]:
        """Run decodes that sat out a step in which no prefill ran after all, ahead of the
        step's other sequences (decodes come first); returns the budget left and the step's
        number of decodes."""
        late = SchedulerOutput()
        for request in deferred:
            budget = self._run(request, budget, late, scheduled)
        out.seqs[:0] = late.seqs
        out.preempted.extend(late.preempted)
        out.finished.extend(late.finished)
        out.num_decodes += len(late.seqs)
        return budget, out.num_decodes

    def _num_active_tenants(self) -> int:
        """Tenants with requests running or waiting; O(tenants)."""
        return len(self.slots.keys() | self.policy.num_waiting_by_tenant().keys())

    def _add_drafts(self, out: SchedulerOutput, num_decodes: int, budget: int) -> int:
        """Give the step's decodes (the first ``num_decodes`` sequences) drafts from what is
        left of the budget once every prefill chunk and admission had its share; returns the
        budget left. A step of more than ``max_draft_batch`` decodes drafts nothing."""
        drafter = self.drafter
        if drafter is None or (
            self.max_draft_batch is not None and num_decodes > self.max_draft_batch
        ):
            return budget
        for i in range(num_decodes):
            if budget == 0:
                break
            seq = out.seqs[i]
            request = seq.request
            if request.status is not RequestStatus.RUNNING or request.num_output_tokens == 0:
                continue
            # The last of max_tokens is always the model's own: a draft stops one short of it.
            limit = min(request.params.max_tokens - request.num_output_tokens - 1, budget)
            if limit <= 0:
                continue
            draft = drafter.propose(request, limit)
            # Pages short of the whole draft: what fits of it runs.
            num_new = self._num_fitting(request, 1 + len(draft))
            if num_new <= 1:
                continue
            self._grow(request, num_new)
            out.seqs[i] = ScheduledSeq(request, num_new, True, tuple(draft[: num_new - 1]))
            self.policy.charge(request, num_new - 1, 0, 0)  # a row each, like prompt tokens
            budget -= num_new - 1
        return budget

    def _run(self, request: Request, budget: int, out: SchedulerOutput, scheduled: set[str]) -> int:
        """Schedule a running request's next tokens (preempting for pages if it must); returns
        the budget left."""
        if request.status is not RequestStatus.RUNNING or budget == 0:
            return budget
        want = min(request.num_remaining_tokens, budget)
        num_new = self._num_fitting(request, want)
        while num_new == 0:
            victim = page_victim(self.running, scheduled, request, self.policy)
            if victim is None:
                break
            self._preempt(victim)
            out.preempted.append(victim)
            num_new = self._num_fitting(request, want)
        if num_new == 0:
            if len(self.running) == 1:
                # Alone and still out of room: the sequence outgrew the whole KV cache.
                self.finish(request, "length")
                out.finished.append(request)
            elif request.is_decoding:
                self._preempt(request)
                out.preempted.append(request)
            return budget  # a prefill chunk waits for pages instead
        is_decode = request.is_decoding and request.num_output_tokens > 0
        self._grow(request, num_new)
        self._add_seq(out, request, num_new, scheduled)
        if is_decode:
            self.policy.charge(request, 0, 0, 1)
        else:
            self.policy.charge(request, num_new, 0, 0)
        return budget - num_new

    def _free_slot_for_fairness(self, out: SchedulerOutput) -> None:
        """Every slot is taken (up to the slot limit) and the next tenant in line is owed one
        (``preemption.slot_victim``): preempt a request of a tenant over its share. Its computed
        full pages stay cached, so it resumes cheaply. At most one per step; O(running)."""
        if len(self.running) < self._slot_limit or not self.cache.shares_pages:
            return
        head = self.policy.peek()
        if head is None:
            return
        victim = slot_victim(self.running, self.slots, head, self._slot_limit, self.policy)
        if victim is not None:
            self._preempt(victim)
            out.preempted.append(victim)

    def _admit(
        self,
        out: SchedulerOutput,
        budget: int,
        scheduled: set[str],
        caps: dict[str, int] | None = None,
        before: Request | None = None,
        foreground_only: bool = False,
        sitting: set[str] | None = None,
    ) -> int:
        """Admit waiting requests in the policy's order while budget and slots last, each
        tenant within its cap (``caps``, spent in place); with ``before`` (a running prefill),
        only those that come ahead of it: a lower service key, or an equal one of another tenant
        (a tenant back from idle is lifted to the counter of the tenant that kept the engine
        busy, and must not queue behind that tenant's chunks). ``foreground_only`` passes over
        the tenants whose next request is background work, ``sitting`` the tenants that sit
        this step out."""
        deferred: list[Request] = []
        skip = {t for t, cap in caps.items() if cap <= 0} if caps else set()
        if sitting:
            skip |= sitting
        while budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.policy.peek(skip)
            if request is None:
                break
            if len(self.running) >= self._slot_limit and not self.budget.admits_past_limit(
                request, self.policy, self.slots
            ):
                break
            if foreground_only and request.background:
                skip.add(request.tenant_id)
                continue
            if before is not None and not self._comes_before(request, before):
                break
            if not self._acquire_adapter(request):
                deferred.append(self.policy.pop(skip))
                continue
            # At least the last token is always run: its logits choose the next token.
            match = self.cache.match(
                request.namespace, request.all_token_ids[:-1], request.allow_public_prefix
            )
            if self._follows_inflight_prefill(request, match.num_tokens):
                # Its prefix is being computed right now: it reuses it in a later step, and the
                # requests behind it (other prefixes) are not held up meanwhile.
                self._release_adapter(request)
                deferred.append(self.policy.pop(skip))
                continue
            self.cache.lock(match.node)
            request.block_table = list(match.page_ids)
            request.num_tree_pages = len(match.page_ids)
            request.num_computed_tokens = match.num_tokens
            want = min(request.num_remaining_tokens, _allowed(budget, caps, request.tenant_id))
            num_new = self._num_fitting(request, want)
            if num_new == 0:
                self._release_adapter(request)
                self.cache.unlock(match.node)
                request.block_table = []
                request.num_tree_pages = 0
                request.num_computed_tokens = 0
                break
            self.policy.pop(skip)
            request.cache_node = match.node
            first_admission = request.num_cached_tokens < 0
            if first_admission:
                request.num_cached_tokens = min(match.num_tokens, request.num_prompt_tokens)
            request.status = RequestStatus.RUNNING
            request.admitted_index = self._num_admissions
            self._num_admissions += 1
            self.running.append(request)
            self.slots[request.tenant_id] = self.slots.get(request.tenant_id, 0) + 1
            self._grow(request, num_new)
            self._add_seq(out, request, num_new, scheduled)
            budget -= num_new
            if _spend(caps, request.tenant_id, num_new):
                skip.add(request.tenant_id)
            num_cached = request.num_cached_tokens if first_admission else 0
            self.policy.charge(request, num_new, num_cached, 0)
        for request in reversed(deferred):
            self.policy.defer(request)
        return budget

    def _acquire_adapter(self, request: Request) -> bool:
        """Pin a slot for the request's adapter (loading it there if needed); False when every
        slot is pinned by other adapters' running requests."""
        if request.lora is None or self.lora_slots is None:
            return True
        slot = self.lora_slots.acquire(request.lora)
        if slot is None:
            return False
        request.lora_slot = slot
        return True

    def _release_adapter(self, request: Request) -> None:
        if request.lora_slot >= 0 and self.lora_slots is not None:
            self.lora_slots.release(request.lora_slot)
        request.lora_slot = -1

    def _comes_before(self, waiting: Request, running: Request) -> bool:
        key = self.policy.service_key
        waiting_key, running_key = key(waiting), key(running)
        return waiting_key < running_key

    def _follows_inflight_prefill(self, request: Request, num_matched: int) -> bool:
        """Whether a running prefill of the same namespace is computing pages ``request`` could
        reuse beyond what it matched: then it waits rather than computing them a second time.

        Costs O(running prefills × shared pages): the current step's work only.
        """
        if not self.cache.shares_pages:
            return False
        page = self.page_size
        tokens = request.all_token_ids
        reusable_limit = (len(tokens) - 1) // page * page
        for other in self.running:
            if other.namespace != request.namespace or other.num_remaining_tokens <= 1:
                continue
            if other.num_computed_tokens >= reusable_limit:
                continue
            shared = num_matched
            other_tokens = other.all_token_ids
            while (
                shared + page <= reusable_limit
                and tokens[shared : shared + page] == other_tokens[shared : shared + page]
            ):
                shared += page
            if shared > num_matched and other.num_computed_tokens < shared:
                return True
        return False

    def _add_seq(
        self, out: SchedulerOutput, request: Request, num_new: int, scheduled: set[str]
    ) -> None:
        sample = request.num_computed_tokens + num_new == request.num_tokens
        out.seqs.append(ScheduledSeq(request, num_new, sample))
        scheduled.add(request.request_id)

    def _num_fitting(self, request: Request, want: int) -> int:
        """How many of ``want`` new tokens the request's pages plus available pages can hold."""
        num_pages = len(request.block_table) + self.cache.num_available_pages
        room = num_pages * self.page_size - request.num_computed_tokens
        return max(0, min(want, room))

    def _grow(self, request: Request, num_new: int) -> None:
        num_tokens = request.num_computed_tokens + num_new
        need = -(-num_tokens // self.page_size) - len(request.block_table)
        if need > 0:
            request.block_table.extend(self.cache.allocate(need, request.owner, request.namespace))

    # -- state changes after a step ---------------------------------------------------------

    def postprocess(
        self, out: SchedulerOutput, rejected: Mapping[Request, int] | None = None
    ) -> None:
        """Advance every scheduled sequence (less the ``rejected`` tail of its draft, whose KV
        is overwritten later); hand completed prefill pages to the cache."""
        for seq in out.seqs:
            request = seq.request
            if request.status is not RequestStatus.RUNNING:
                continue
            was_decode = request.is_decoding and request.num_output_tokens > 0
            request.num_computed_tokens += seq.num_new_tokens
            if rejected:
                request.num_computed_tokens -= rejected.get(request, 0)
            num_full = request.num_computed_tokens // self.page_size
            if not was_decode and num_full > request.num_tree_pages:
                self._cache_pages(request, num_full)

    def finish(self, request: Request, reason: str) -> None:
        """End a running or waiting request: cache its computed pages, release the rest."""
        if request.status is RequestStatus.RUNNING:
            if request.publish and reason != "abort":
                self._publish(request)
            self._release(request)
            self._remove_running(request)
        elif request.status is RequestStatus.WAITING:
            self.policy.remove(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason

    def _preempt(self, request: Request) -> None:
        self._release(request)
        self._remove_running(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING
        request.queued_at = self.clock()
        self.policy.requeue_front(request)
        log.info(
            "request_preempted",
            request_id=request.request_id,
            tenant_id=request.tenant_id,
            num_tokens=request.num_tokens,
        )

    def _remove_running(self, request: Request) -> None:
        self.running.remove(request)
        self._release_adapter(request)
        left = self.slots[request.tenant_id] - 1
        if left:
            self.slots[request.tenant_id] = left
        else:
            del self.slots[request.tenant_id]

    def _release(self, request: Request) -> None:
        num_full = request.num_computed_tokens // self.page_size
        if num_full > request.num_tree_pages:
            self._cache_pages(request, num_full)
        self.cache.unlock(request.cache_node)
        request.cache_node = None
        owner = self.cache.pool.owner
        private = [page for page in request.block_table if owner(page) == request.owner]
        self.cache.free(private)
        request.block_table = []
        request.num_tree_pages = 0

    def _publish(self, request: Request) -> None:
        """Hand a computed public prefix to the cache, pinned; its full pages leave the request."""
        num_full = request.num_computed_tokens // self.page_size
        request.num_published_tokens = self.cache.publish(
            request.all_token_ids[: num_full * self.page_size],
            request.block_table[:num_full],
            request.owner,
            request.cache_node,
        )
        request.cache_node = None
        request.num_tree_pages = num_full

    def _cache_pages(self, request: Request, num_full: int) -> None:
        tokens = request.all_token_ids[: num_full * self.page_size]
        result = self.cache.cache(
            request.namespace,
            tokens,
            request.block_table[:num_full],
            request.owner,
            request.cache_node,
        )
        request.block_table[:num_full] = result.page_ids
        request.cache_node = result.node
        request.num_tree_pages = num_full


def _allowed(budget: int, caps: dict[str, int] | None, tenant_id: str) -> int:
    """What a tenant's prefill may take of the step's ``budget`` under ``caps``."""
    if caps is None or tenant_id not in caps:
        return budget
    return min(budget, caps[tenant_id])


def _spend(caps: dict[str, int] | None, tenant_id: str, num_tokens: int) -> bool:
    """Charge a tenant's prefill tokens to its cap; True when that used the cap up."""
    if caps is None or tenant_id not in caps:
        return False
    caps[tenant_id] -= num_tokens
    return caps[tenant_id] <= 0
