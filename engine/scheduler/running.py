"""The running set: requests admitted and holding pages, their slots per tenant, and the state
changes of a step (admission, advance, preemption, finish); the waiting queue is the policy's."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import structlog

from engine.policy import AdmissionPolicy
from engine.request import Request, RequestStatus
from engine.scheduler import admission
from engine.scheduler.budget import StepBudget
from engine.scheduler.output import ScheduledSeq, SchedulerOutput
from engine.scheduler.pages import RequestPages
from radix_cache.prefix_cache import PrefixCache

if TYPE_CHECKING:
    from engine.lora.slots import AdapterSlots

log = structlog.get_logger(__name__)


class RunningSet:
    """Owns the running requests; the admission policy owns the waiting queue."""

    def __init__(
        self,
        cache: PrefixCache,
        policy: AdmissionPolicy,
        max_num_seqs: int,
        budget: StepBudget | None,
        clock: Callable[[], float],
    ) -> None:
        self.cache = cache
        self.pages = RequestPages(cache)
        self.policy = policy
        self.page_size = cache.page_size
        self.max_num_seqs = max_num_seqs
        self.budget = budget or StepBudget()
        self.clock = clock
        self.running: list[Request] = []  # in order of admission
        self.slots: dict[str, int] = {}  # running requests per tenant
        policy.bind_running(self.slots, max_num_seqs)
        # Resident LoRA adapters (engine/lora/): a request runs only while its adapter holds a
        # slot; one whose adapter finds every slot pinned waits, and the others go ahead.
        self.lora_slots: AdapterSlots | None = None
        self._num_admissions = 0

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.policy)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.running) or len(self.policy) > 0

    def add(self, request: Request) -> None:
        """Queue a new request, due by its tenant's first-token target (background work and
        requests that already have their first token carry no deadline)."""
        request.status = RequestStatus.WAITING
        request.arrival_s = self.clock()
        if not request.background and request.num_output_tokens == 0:
            ttft_s = request.target_ttft_s or self.budget.ttft_s
            request.deadline_s = request.arrival_s + ttft_s
        self.policy.add(request)

    def waiting_by_tenant(self) -> dict[str, tuple[int, float]]:
        """Per tenant: requests waiting and the longest wait in seconds so far."""
        now = self.clock()
        out: dict[str, tuple[int, float]] = {}
        for request in self.policy.waiting():
            count, wait = out.get(request.tenant_id, (0, 0.0))
            out[request.tenant_id] = (count + 1, max(wait, now - request.arrival_s))
        return out

    def _start(self, request: Request, num_matched: int) -> None:
        if request.num_cached_tokens < 0:  # first admission
            request.num_cached_tokens = min(num_matched, request.num_prompt_tokens)
        request.status = RequestStatus.RUNNING
        request.admitted_index = self._num_admissions
        self._num_admissions += 1
        self.running.append(request)
        self.slots[request.tenant_id] = self.slots.get(request.tenant_id, 0) + 1

    def _add_seq(
        self, out: SchedulerOutput, request: Request, num_new: int, scheduled: set[str]
    ) -> None:
        self.pages.grow(request, num_new)
        sample = request.num_computed_tokens + num_new == request.num_tokens
        out.seqs.append(ScheduledSeq(request, num_new, sample))
        scheduled.add(request.request_id)

    # -- state changes after a step ---------------------------------------------------------

    def postprocess(
        self, out: SchedulerOutput, rejected: Mapping[Request, int] | None = None
    ) -> None:
        """Advance every scheduled sequence (less the ``rejected`` tail of its draft, whose KV
        is overwritten later); hand completed prefill pages to the cache. A request's first
        token due, its deadline is met or missed: it carries none from now on."""
        for seq in out.seqs:
            request = seq.request
            if request.status is not RequestStatus.RUNNING:
                continue
            was_decode = request.is_decoding and request.num_output_tokens > 0
            request.num_computed_tokens += seq.num_new_tokens
            if rejected:
                request.num_computed_tokens -= rejected.get(request, 0)
            if seq.sample:
                request.deadline_s = float("inf")
            if not was_decode:
                self.pages.cache_computed(request)

    def finish(self, request: Request, reason: str) -> None:
        """End a running or waiting request: cache its computed pages, release the rest."""
        if request.status is RequestStatus.RUNNING:
            if request.publish and reason != "abort":
                self.pages.publish(request)
            self.pages.release(request)
            self._remove_running(request)
        elif request.status is RequestStatus.WAITING:
            self.policy.remove(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.pages.release(request)
        self._remove_running(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self.policy.requeue_front(request)
        out.preempted.append(request)
        log.info(
            "request_preempted",
            request_id=request.request_id,
            tenant_id=request.tenant_id,
            num_tokens=request.num_tokens,
        )

    def _remove_running(self, request: Request) -> None:
        self.running.remove(request)
        admission.release_adapter(self.lora_slots, request)
        left = self.slots[request.tenant_id] - 1
        if left:
            self.slots[request.tenant_id] = left
        else:
            del self.slots[request.tenant_id]
