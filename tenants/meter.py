"""The usage meter: non-blocking ``record``, batched background writes, spool and replay.

Each event ends up in the database exactly once: writes are insert-or-ignore on request_id,
failed batches are fsync'd to the spool, and the spool is replayed (then cleared) once a write
succeeds again. A replay after a crash between write and clear only re-inserts duplicates,
which the database ignores.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import structlog

from tenants.errors import MeterClosedError
from tenants.records import UsageEvent
from tenants.spool import Spool

log = structlog.get_logger("tenants.meter")
_Item = UsageEvent | asyncio.Future[None] | None  # None asks the loop to stop


class EventSink(Protocol):
    async def write(self, events: Sequence[UsageEvent]) -> int: ...


class UsageMeter:
    def __init__(
        self,
        sink: EventSink,
        spool_path: Path,
        *,
        batch_size: int = 256,
        retry_interval_s: float = 5.0,
    ) -> None:
        self._sink = sink
        self._spool = Spool(spool_path)
        self._batch_size = batch_size
        self._retry_interval_s = retry_interval_s
        self._queue: asyncio.Queue[_Item] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._next_retry = 0.0

    async def start(self) -> None:
        """Start the writer task; it first replays whatever an earlier run left spooled."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="usage-meter")

    def record(self, event: UsageEvent) -> None:
        """Queue one event; never blocks and never raises for database trouble."""
        if self._closed:
            raise MeterClosedError("the usage meter is closed")
        self._queue.put_nowait(event)

    async def flush(self) -> None:
        """Wait until every event recorded so far is in the database or the spool."""
        task = self._task
        if task is None or task.done():
            raise MeterClosedError("the usage meter is not running")
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queue.put_nowait(done)
        # Never wait on a writer that is gone: if the task ends first (closed, or failed on
        # something it could not spool), say so instead of hanging.
        await asyncio.wait((done, task), return_when=asyncio.FIRST_COMPLETED)
        if not done.done():
            error = None if task.cancelled() else task.exception()
            raise MeterClosedError(f"the usage meter stopped: {error!r}")

    async def close(self) -> None:
        """Drain the queue, try a last replay, stop the task."""
        if self._closed or self._task is None:
            self._closed = True
            return
        self._closed = True
        self._queue.put_nowait(None)
        await asyncio.shield(self._task)

    @property
    def spooled(self) -> bool:
        return not self._spool.is_empty

    async def _run(self) -> None:
        await self._replay()
        while True:
            batch = [await self._next_item()]
            while len(batch) < self._batch_size and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            events = [item for item in batch if isinstance(item, UsageEvent)]
            waiters = [item for item in batch if isinstance(item, asyncio.Future)]
            if events:
                await self._deliver(events)
            if waiters or None in batch or time.monotonic() >= self._next_retry:
                await self._replay()
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(None)
            if None in batch:
                return

    async def _next_item(self) -> _Item:
        if self._spool.is_empty:
            return await self._queue.get()
        try:  # wake up to retry the spool even when no new events arrive
            return await asyncio.wait_for(self._queue.get(), self._retry_interval_s)
        except TimeoutError:
            return asyncio.get_running_loop().create_future()

    async def _deliver(self, events: list[UsageEvent]) -> None:
        try:
            await self._sink.write(events)
        except Exception as exc:  # any database failure: keep the events durably instead
            await asyncio.to_thread(self._spool.append, events)
            self._next_retry = time.monotonic() + self._retry_interval_s
            log.warning("usage_spooled", events=len(events), error=type(exc).__name__)

    async def _replay(self) -> None:
        if self._spool.is_empty:
            return
        events = await asyncio.to_thread(self._spool.read)
        try:
            for start in range(0, len(events), self._batch_size):
                await self._sink.write(events[start : start + self._batch_size])
        except Exception as exc:
            self._next_retry = time.monotonic() + self._retry_interval_s
            log.warning("usage_replay_failed", events=len(events), error=type(exc).__name__)
            return
        await asyncio.to_thread(self._spool.clear)
        log.info("usage_replayed", events=len(events))
