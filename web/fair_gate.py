"""A gate that lets a few holders in at once and, when full, takes tenants in turn.

Admission runs a SQL transaction per request; on SQLite those transactions queue one after the
other. When one tenant sends a burst of forty requests and three others send four each at the
same moment, a first-come queue would admit the forty first and the other tenants' requests would
reach the engine last. The gate keeps a queue per tenant and wakes the tenants' waiters in
rotation (one grant per tenant per turn), so every tenant's first request is admitted within the
first few grants, whatever the others sent.

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
        # Tenants with waiters, in turn order (a dict keeps insertion order): the first is next.
        self._waiters: dict[str, deque[asyncio.Future[None]]] = {}

    @property
    def num_waiting(self) -> int:
        return sum(len(queue) for queue in self._waiters.values())

    @contextlib.asynccontextmanager
    async def hold(self, tenant_id: str) -> AsyncIterator[None]:
        await self._acquire(tenant_id)
        try:
            yield
        finally:
            self._release()

    async def _acquire(self, tenant_id: str) -> None:
        if self.num_held < self.capacity and not self._waiters:
            self.num_held += 1
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
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
            tenant_id, queue = next(iter(self._waiters.items()))
            future = queue.popleft()
            del self._waiters[tenant_id]
            if queue:
                self._waiters[tenant_id] = queue  # its next waiter goes to the back of the turn
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
            del self._waiters[tenant_id]
