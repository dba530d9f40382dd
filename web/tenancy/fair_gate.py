"""A gate that lets a few holders in at once and, when full, takes tenants in turn by weight.

Admission runs a SQL transaction per request; on SQLite those transactions queue one after the
other. When one tenant sends a burst of forty requests and three others send four each at the
same moment, a first-come queue would admit the forty first and the other tenants' requests would
reach the engine last. The gate keeps a queue per tenant and wakes the tenants' waiters by
stride: each grant moves its tenant's pass on by 1/weight and the waiting tenant with the lowest
pass goes next (a tenant that starts waiting joins at the lowest pass of those already waiting,
so waiting earlier banks nothing). With equal weights that is a rotation, one grant per tenant
per turn; a tenant of weight 2 gets two grants in the time one of weight 1 gets one. Every
tenant's first request is admitted within the first few grants, whatever the others sent.

Waiting is cancellable: a waiter whose client went away leaves its queue, and a grant that
arrives just as its waiter is cancelled is passed on, so no slot is ever lost.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator


class FairGate:
    """At most ``capacity`` holders at once; waiters are woken one tenant at a time, in turn."""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError("capacity must be positive")
        self.capacity = capacity
        self.num_held = 0
        # Tenants with waiters, each with its pass, weight and the order it started waiting in.
        self._waiters: dict[str, deque[asyncio.Future[None]]] = {}
        self._passes: dict[str, tuple[float, int]] = {}
        self._weights: dict[str, float] = {}
        self._joined = 0

    @property
    def num_waiting(self) -> int:
        return sum(len(queue) for queue in self._waiters.values())

    @contextlib.asynccontextmanager
    async def hold(self, tenant_id: str, weight: float = 1.0) -> AsyncIterator[None]:
        await self._acquire(tenant_id, weight if weight > 0 else 1.0)
        try:
            yield
        finally:
            self._release()

    async def _acquire(self, tenant_id: str, weight: float) -> None:
        if self.num_held < self.capacity and not self._waiters:
            self.num_held += 1
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if tenant_id not in self._waiters:
            floor = min((p for p, _ in self._passes.values()), default=0.0)
            self._passes[tenant_id] = (floor, self._joined)
            self._joined += 1
        self._weights[tenant_id] = weight
        self._waiters.setdefault(tenant_id, deque()).append(future)
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self._release()  # granted as the waiter was cancelled: hand the slot on
            else:
                self._forget(tenant_id, future)
            raise

    def _release(self) -> None:
        self.num_held -= 1
        self._wake()

    def _wake(self) -> None:
        while self.num_held < self.capacity and self._waiters:
            tenant_id = min(self._waiters, key=self._passes.__getitem__)  # O(waiting tenants)
            queue = self._waiters[tenant_id]
            future = queue.popleft()
            if queue:
                pass_, joined = self._passes[tenant_id]
                self._passes[tenant_id] = (pass_ + 1.0 / self._weights[tenant_id], joined)
            else:
                self._leave(tenant_id)
            if future.done():  # cancelled while queued
                continue
            self.num_held += 1
            future.set_result(None)

    def _forget(self, tenant_id: str, future: asyncio.Future[None]) -> None:
        queue = self._waiters.get(tenant_id)
        if queue is None:
            return
        with contextlib.suppress(ValueError):
            queue.remove(future)
        if not queue:
            self._leave(tenant_id)

    def _leave(self, tenant_id: str) -> None:
        del self._waiters[tenant_id], self._passes[tenant_id], self._weights[tenant_id]
