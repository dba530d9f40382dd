"""The step scheduler: decodes first, then prefill chunks and admissions, under a token budget.

Prefill chunks run in the policy's service order, and a waiting request that comes before a
chunk in that order (a less-served tenant's, under fair share) is admitted ahead of it. The policy
may cap what a tenant's prefill takes of a step (``prefill_caps``): under fair share, tenants
served ahead of the least-served one get their weighted share of the budget, so a step stays
short and the next prompt of a tenant behind them waits for one short step. With a step-time
target (``engine/step_target.py``) the target bounds instead how many requests run and how much
prefill goes beside their decodes, and the decodes of tenants served far more than one whose
prompt waits sit out a step so that the prompt fits in it (the policy's ``decode_lead``); a
tenant far ahead (``yield_lead``) sits out such a step with all its work. With a first-token target
(``ttft_target_s``), the oldest wait for a first token past it stretches the step-time target;
decodes past the unstretched target then run by weight (tenants ahead by ``decode_lead`` sit
out), a tenant that far behind a running one is admitted past the slot limit, and prompts keep
their share of the step (``StepTarget.prefill_share``).

Pure Python (no torch). Pages come from a ``PrefixCache``; a request's block table holds its
locked cached prefix first, then its private pages. Under memory pressure chunks shrink; a decode
that cannot get a page preempts the most recently admitted running request.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple, Protocol

import structlog

from engine.policy import AdmissionPolicy
from engine.request import Request, RequestStatus
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


# The most a first token overdue stretches the step-time target (then slots and the token
# budget bound the step).
MAX_STRETCH = 64.0


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
        self.target = target  # the step-time bound on running requests and prefill, if any
        # The first-token target: a first token overdue stretches the step-time target.
        self.ttft_target_s = ttft_target_s
        self.clock = clock
        self._awaiting_first: deque[tuple[float, Request]] = deque()  # in arrival order
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
    def slot_limit(self) -> int:
        """Requests that may run at once now: the slots, or fewer while the step-time target
        holds fewer decodes."""
        if self.target is None:
            return self.max_num_seqs
        return min(self.max_num_seqs, self.target.max_decodes)

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
        request.queued_at = now = self.clock()
        self.policy.add(request)
        if self.target is not None and self.ttft_target_s is not None:
            self._awaiting_first.append((now, request))

    def _stretch(self) -> float:
        """How far the step-time target stretches this step: by the square of the oldest
        first-token wait over the first-token target, once it is past it (amortized O(1):
        requests leave the front once they have a token or are gone)."""
        pending = self._awaiting_first
        while pending and (
            pending[0][1].output_token_ids or pending[0][1].status is RequestStatus.FINISHED
        ):
            pending.popleft()
        if not pending or self.ttft_target_s is None:
            return 1.0
        overdue = (self.clock() - pending[0][0]) / self.ttft_target_s
        return min(max(1.0, overdue * overdue), MAX_STRETCH)

    # -- schedule -------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled: set[str] = set()
        if self.target is not None:
            self.target.stretch = self._stretch()
        self._slot_limit = self.slot_limit
        self.policy.begin_step()
        self._free_slot_for_fairness(out)
        num_fair_preemptions = len(out.preempted)
        key = self.policy.service_key
        decodes = [r for r in self.running if r.num_remaining_tokens == 1]
        # Unfinished prefills in the policy's order (the least-served tenant's first; the sort
        # is stable, so admission order within a tenant).
        prefills = sorted((r for r in self.running if r.num_remaining_tokens > 1), key=key)
        decodes, deferred, foreground_only = self._yield_background(decodes, prefills)
        # Beside a foreground prompt, background prompts sit out as well (they keep their pages).
        held = [r for r in prefills if r.background] if foreground_only else []
        if held:
            prefills = [r for r in prefills if not r.background]
        sitting: set[str] = set()  # tenants far ahead: none of their work runs this step
        if self.target is not None:
            decodes, ahead, sitting = self._defer_decodes_ahead(decodes, prefills)
            deferred += ahead
            if sitting:
                held += [r for r in prefills if r.tenant_id in sitting]
                prefills = [r for r in prefills if r.tenant_id not in sitting]
        if self.ttft_target_s is not None and self.target is not None:
            decodes = self._trim_decodes_ahead(decodes, prefills)
        for request in decodes:
            budget = self._run(request, budget, out, scheduled)
        num_decodes = out.num_decodes = len(out.seqs)
        # Within a step-time target, prefill gets what the decodes leave of the step's time. With
        # no decode running, one tenant alone takes the whole budget (nobody waits on its step),
        # but several tenants' prompts go in short steps, least served first, so that a flood's
        # prompts do not lengthen the step that gives the others their first tokens.
        held_back = 0
        if self.target is not None and (num_decodes or self._num_active_tenants() > 1):
            room = self.target.prefill_budget(num_decodes)
            if self.ttft_target_s is not None:
                # Decodes past the target (admitted for overdue first tokens) never squeeze the
                # prompts below their share: the prompts are what the first-token target is for.
                room = max(room, self.target.prefill_share())
            held_back = max(0, budget - room)
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

    def _defer_decodes_ahead(
        self, decodes: list[Request], prefills: list[Request]
    ) -> tuple[list[Request], list[Request], set[str]]:
        """The decodes that run this step, those that sit it out, and the tenants none of whose
        work runs. Within a step-time target, the decodes of tenants served far more
        (``policy.decode_lead``) than a tenant whose prompt is waiting sit this step out, the
        most-served first, until the step has room for that prompt (when sitting out can make
        it fit at all): a flood's decodes then do not lengthen the first token of the tenants
        it would crowd out, and its counter stands still while theirs catch up. Tenants ahead
        by ``policy.yield_lead`` or more sit out with all their work, so the prompt's step is
        as short as its own tenants' work makes it. O(running)."""
        lead = self.policy.decode_lead
        target = self.target
        if lead is None or target is None or not decodes:
            return decodes, [], set()
        served = self.policy.service
        pending = self._pending_prompts(prefills)
        if not pending:
            return decodes, [], set()
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
        if self.policy.yield_lead is not None:
            far = least + self.policy.yield_lead
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

    def _trim_decodes_ahead(self, decodes: list[Request], prefills: list[Request]) -> list[Request]:
        """The decodes that run when more run than the step-time target holds (requests admitted
        while a first token was overdue): the decodes of tenants served more than
        ``policy.decode_lead`` ahead of the least-served tenant with work in the step sit out,
        the most served first, until the rest fit the unstretched target. Tenants within the
        lead of each other all run: the step outgrows its target rather than anyone starving,
        and the target's room goes by weight where a queue would have ordered it.
        O(running log running)."""
        lead = self.policy.decode_lead
        assert self.target is not None
        excess = len(decodes) - self.target.decodes_within(1.0)
        if lead is None or excess <= 0:
            return decodes
        served = self.policy.service
        least = min(served(r.tenant_id) for r in (*decodes, *prefills))
        ahead = sorted(
            (r for r in decodes if served(r.tenant_id) > least + lead),
            key=lambda r: (served(r.tenant_id), r.admitted_index),
        )
        if not ahead:
            return decodes
        sit_out = {r.request_id for r in ahead[max(0, len(ahead) - excess) :]}
        return [r for r in decodes if r.request_id not in sit_out]

    def _behind_running(self, request: Request) -> bool:
        """Within a first-token target, whether the waiting ``request``'s tenant is served more
        than ``policy.decode_lead`` less than a tenant with requests running: then it is
        admitted past the slot limit, and the decodes of the tenant ahead sit the steps out
        (``_trim_decodes_ahead``) rather than keep the tenant behind waiting for its requests to
        end. O(running tenants)."""
        lead = self.policy.decode_lead
        if self.ttft_target_s is None or self.target is None or lead is None or not self.slots:
            return False
        served = self.policy.service
        return served(request.tenant_id) + lead < max(served(t) for t in self.slots)

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
            victim = self._pick_victim(scheduled, request)
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
        """Every slot is taken (up to the slot limit) and the next tenant in line holds fewer
        slots than its weighted share while another holds more: preempt one of the other's
        requests (chosen by the policy, which takes none from a tenant served less than the
        next one) so the newcomer does not wait for long generations to end. The victim's
        computed full pages stay cached, so it resumes cheaply. At most one per step;
        O(running)."""
        limit = self._slot_limit
        if len(self.running) < limit or not self.cache.shares_pages:
            return
        head = self.policy.peek()
        if head is None:
            return
        slots = self.slots
        weights: dict[str, float] = {head.tenant_id: head.tenant_weight}
        for request in self.running:
            weights[request.tenant_id] = request.tenant_weight
        total_weight = sum(max(w, 1e-9) for w in weights.values())

        def fair(tenant_id: str) -> float:
            return limit * max(weights[tenant_id], 1e-9) / total_weight

        if slots.get(head.tenant_id, 0) + 1 > fair(head.tenant_id):
            return
        over = [r for r in self.running if slots[r.tenant_id] - 1 >= fair(r.tenant_id)]
        victim = self.policy.pick_victim(over, beneficiary=head)
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
            if len(self.running) >= self._slot_limit and not self._behind_running(request):
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

    def _pick_victim(self, scheduled: set[str], requester: Request) -> Request | None:
        """A running request to preempt for ``requester``'s pages. A prompt takes pages only
        from requests admitted after it: two prompts that each need most of the pages would
        otherwise take them from each other in turn and neither would ever finish (a decode
        moves on by a token each time, so it may take from any)."""
        prefill = requester.num_remaining_tokens > 1
        candidates = [
            request
            for request in self.running
            if request is not requester
            and request.request_id not in scheduled
            and not (prefill and request.admitted_index < requester.admitted_index)
        ]
        return self.policy.pick_victim(candidates)

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
