"""Admission policy: which waiting request the scheduler admits next (FIFO for now).

The scheduler only talks to the ``AdmissionPolicy`` interface, so a weighted fair-share queue
(with longest-cached-prefix-first within a tenant) can replace ``FifoPolicy`` unchanged.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Mapping

from engine.request import Request, RequestStatus


class AdmissionPolicy(ABC):
    """The waiting queue. Not thread-safe: only the engine thread calls it."""

    @abstractmethod
    def add(self, request: Request) -> None:
        """Queue a new request."""

    @abstractmethod
    def peek(self) -> Request | None:
        """The request that ``pop`` would return, without removing it."""

    @abstractmethod
    def pop(self) -> Request:
        """Remove and return the next request to admit; IndexError when empty."""

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

    def bind_prefix_len(self, prefix_len: Callable[[Request], int]) -> None:
        """Receive the engine's cached-prefix measure (used by locality-aware policies)."""
        return None

    def bind_running(self, slots: Mapping[str, int], max_num_seqs: int) -> None:
        """Receive the scheduler's live count of running requests per tenant (kept up to date by
        the scheduler) and the number of slots (used by slot-aware policies)."""
        return None

    def service_key(self, request: Request) -> float:
        """Order of prefill work within a step: lower goes first. Admission order by default (a
        waiting request sorts after every running one)."""
        if request.status is not RequestStatus.RUNNING:
            return float("inf")
        return float(request.admitted_index)

    def pick_victim(self, candidates: list[Request]) -> Request | None:
        """The running request to preempt when pages run out: the most recently admitted."""
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

    def peek(self) -> Request | None:
        return self._queue[0] if self._queue else None

    def pop(self) -> Request:
        return self._queue.popleft()

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
