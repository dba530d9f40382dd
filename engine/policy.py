"""Admission policy: the waiting queue, and which request the scheduler admits next.

The scheduler only talks to ``AdmissionPolicy``; ``FifoPolicy`` serves in arrival order and
``engine/fair_share.py`` by weighted virtual counters with first-token deadlines.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Collection, Mapping

from engine.request import Request, RequestStatus

# Seconds a prompt of this many uncached tokens needs to its first token at the current rates.
Horizon = Callable[[int], float]


class AdmissionPolicy(ABC):
    """The waiting queue. Not thread-safe: only the engine thread calls it."""

    _now: float = 0.0
    _horizon: Horizon | None = None

    @abstractmethod
    def add(self, request: Request) -> None:
        """Queue a new request."""

    @abstractmethod
    def peek(self, skip: Collection[str] = ()) -> Request | None:
        """The request that ``pop`` would return, without removing it."""

    @abstractmethod
    def pop(self, skip: Collection[str] = ()) -> Request:
        """Remove and return the next request to admit, passing over the tenants in ``skip``;
        IndexError when none is left."""

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

    @abstractmethod
    def waiting(self) -> list[Request]:
        """A snapshot of the queued requests in arrival order."""

    def charge(self, request: Request, num_uncached: int, num_cached: int, num_output: int) -> None:
        """Account work done for ``request`` as it is scheduled (fair-share counters)."""
        return None

    def counter(self, tenant_id: str) -> float:
        """The service a tenant has had (weighted); equal for all without fair share."""
        return 0.0

    def num_waiting_by_tenant(self) -> dict[str, int]:
        """Waiting requests per tenant id (for stats)."""
        counts: dict[str, int] = {}
        for request in self.waiting():
            counts[request.tenant_id] = counts.get(request.tenant_id, 0) + 1
        return counts

    def bind_prefix_len(self, prefix_len: Callable[[Request], int]) -> None:
        """Receive the engine's cached-prefix measure (used by locality-aware policies)."""
        return None

    def bind_running(self, slots: Mapping[str, int], max_num_seqs: int) -> None:
        """Receive the scheduler's live count of running requests per tenant."""
        return None

    def begin_step(self, now_s: float, horizon: Horizon) -> None:
        """The clock and the step budget's time-to-first-token estimate, as a step begins."""
        self._now = now_s
        self._horizon = horizon

    def is_due(self, request: Request) -> bool:
        """Whether a waiting request must start now to meet its first-token deadline (late ones
        included): it may then take a slot beyond the step budget's decode limit."""
        if math.isinf(request.deadline_s):
            return False
        tokens = self._uncached_tokens(request)
        need = self._horizon(tokens) if self._horizon is not None else 0.0
        return request.deadline_s - need <= self._now

    def _uncached_tokens(self, request: Request) -> int:
        """The prompt tokens a waiting request will have to compute (all, unless known)."""
        return request.num_tokens

    def service_key(self, request: Request) -> tuple[float, ...]:
        """Order of prefill work within a step: lower goes first. Admission order by default (a
        waiting request sorts after every running one)."""
        if request.status is not RequestStatus.RUNNING:
            return (float("inf"),)
        return (float(request.admitted_index),)

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
