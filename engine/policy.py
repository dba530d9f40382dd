"""Admission policy: which waiting request the scheduler admits next (FIFO for now).

The scheduler only talks to the ``AdmissionPolicy`` interface, so a weighted fair-share queue
(with longest-cached-prefix-first within a tenant) can replace ``FifoPolicy`` unchanged.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Collection, Mapping

from engine.request import Request, RequestStatus


class AdmissionPolicy(ABC):
    """The waiting queue. Not thread-safe: only the engine thread calls it."""

    @abstractmethod
    def add(self, request: Request) -> None:
        """Queue a new request."""

    @abstractmethod
    def peek(self, skip: Collection[str] = ()) -> Request | None:
        """The request that ``pop`` would return, without removing it."""

    @abstractmethod
    def pop(self, skip: Collection[str] = ()) -> Request:
        """Remove and return the next request to admit, passing over the tenants in ``skip``
        (those that have had their share of this step); IndexError when none is left."""

    @abstractmethod
    def remove(self, request: Request) -> bool:
        """Drop a waiting request (abort); False if it was not queued."""

    @abstractmethod
    def requeue_front(self, request: Request) -> None:
        """Put back a preempted request so it is admitted before newer work."""

    def defer(self, request: Request) -> None:
        """Put back a request just taken with ``pop`` that cannot start this step (its prefix is
        being computed), ahead of its tenant's newer work, as if it had never left the queue."""
        self.requeue_front(request)

    @abstractmethod
    def __len__(self) -> int: ...

    def charge(self, request: Request, num_uncached: int, num_cached: int, num_output: int) -> None:
        """Account work done for ``request`` as it is scheduled (fair-share counters)."""
        return None

    def num_waiting_by_tenant(self) -> dict[str, int]:
        """Waiting requests per tenant id (for stats)."""
        counts: dict[str, int] = {}
        for request in self.waiting():
            counts[request.tenant_id] = counts.get(request.tenant_id, 0) + 1
        return counts

    @abstractmethod
    def waiting(self) -> list[Request]:
        """A snapshot of the queued requests in admission order."""

    def prefill_caps(self, budget: int) -> dict[str, int] | None:
        """The most prefill tokens each listed tenant may run in a step whose prefill budget is
        ``budget`` (tenants not listed are not capped); None caps nobody."""
        return None

    def bind_prefix_len(self, prefix_len: Callable[[Request], int]) -> None:
        """Receive the engine's cached-prefix measure (used by locality-aware policies)."""
        return None

    def bind_running(self, slots: Mapping[str, int], max_num_seqs: int) -> None:
        """Receive the scheduler's live count of running requests per tenant (kept up to date by
        the scheduler) and the number of slots (used by slot-aware policies)."""
        return None

    def begin_step(self) -> None:
        """Called by the scheduler as a step's schedule begins (policies that order by the
        state of the whole engine take it here, once a step)."""
        return None

    def service_key(self, request: Request) -> tuple[float, ...]:
        """Order of prefill work within a step: lower goes first. Admission order by default (a
        waiting request sorts after every running one)."""
        if request.status is not RequestStatus.RUNNING:
            return (float("inf"),)
        return (float(request.admitted_index),)

    def prefill_key(self, request: Request) -> tuple[float, ...]:
        """Order of the admitted prompts' chunks within a step: lower goes first. Admission
        order by default."""
        return self.service_key(request)

    def service(self, tenant_id: str) -> float:
        """The work a tenant has been served, in the units of ``decode_lead``."""
        return 0.0

    @property
    def decode_lead(self) -> float | None:
        """How far (in ``service`` units) a tenant must be ahead of one whose prompt waits
        before its decodes may sit out a step for that prompt (within a step-time target);
        None: decodes never do (admission order says nothing about who was served more)."""
        return None

    @property
    def yield_lead(self) -> float | None:
        """How far ahead a tenant must be for all its work (decodes, prompt chunks, admissions)
        to sit out a step in which the waiting prompt can end; None: never."""
        return None

    def pick_victim(
        self, candidates: list[Request], beneficiary: Request | None = None
    ) -> Request | None:
        """The running request to preempt when pages run out (or, with ``beneficiary``, to
        give a slot to that waiting request): the most recently admitted."""
        if not candidates:
            return None
        return max(candidates, key=lambda request: request.admitted_index)


class FifoPolicy(AdmissionPolicy):
    """First come, first served; preempted requests go back to the head."""

    __slots__ = ("_queue",)

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def peek(self, skip: Collection[str] = ()) -> Request | None:
        if not skip:
            return self._queue[0] if self._queue else None
        return next((r for r in self._queue if r.tenant_id not in skip), None)

    def pop(self, skip: Collection[str] = ()) -> Request:
        request = self.peek(skip)
        if request is None:
            raise IndexError("no waiting request")
        if request is self._queue[0]:
            return self._queue.popleft()
        self._queue.remove(request)
        return request

    def remove(self, request: Request) -> bool:
        try:
            self._queue.remove(request)
        except ValueError:
            return False
        return True

    def requeue_front(self, request: Request) -> None:
        self._queue.appendleft(request)

    def __len__(self) -> int:
        return len(self._queue)

    def waiting(self) -> list[Request]:
        return list(self._queue)
