"""The usage meter: non-blocking ``record``, batched background writes, spool and replay.

Each event ends up in the database exactly once: writes are insert-or-ignore on request_id,
failed batches are fsync'd to the spool, and the spool is replayed (then cleared) once a write
succeeds again. A replay after a crash between write and clear only re-inserts duplicates,
which the database ignores. When the spool cannot be written either (disk full, read-only),
the events are held in memory and retried, and ``healthy`` is False until they are stored.
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
        self._held: list[UsageEvent] = []  # in neither the database nor the spool yet

    async def start(self) -> None:
        """Take the spool (SpoolInUseError if another process has it), then start the writer
        task; it first replays whatever an earlier run left spooled."""
        if self._task is None:
            await asyncio.to_thread(self._spool.lock)
            self._task = asyncio.create_task(self._run(), name="usage-meter")

    def record(self, event: UsageEvent) -> None:
        """Queue one event; never blocks and never raises for database trouble."""
        if self._closed:
            raise MeterClosedError("the usage meter is closed")
        self._queue.put_nowait(event)

    async def flush(self) -> None:
        """Wait until every event recorded so far is in the database or the spool, or held in
        memory when neither would take it (then ``healthy`` is False)."""
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
        try:
            await asyncio.shield(self._task)
        finally:
            self._spool.unlock()
        if self._held:
            log.error("usage_lost", events=len(self._held))

    @property
    def spooled(self) -> bool:
        return not self._spool.is_empty

    @property
    def held(self) -> int:
        """Events kept in memory only: neither the database nor the spool took them."""
        return len(self._held)

    @property
    def healthy(self) -> bool:
        """Whether every recorded event is durable (or on its way): nothing held in memory only,
        and the writer task alive."""
        task = self._task
        return not self._held and (task is None or not task.done() or self._closed)

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
                await self._rescue()
                await self._replay()
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(None)
            if None in batch:
                return

    async def _next_item(self) -> _Item:
        if self._spool.is_empty and not self._held:
            return await self._queue.get()
        try:  # wake up to retry the spool even when no new events arrive
            return await asyncio.wait_for(self._queue.get(), self._retry_interval_s)
        except TimeoutError:
            return asyncio.get_running_loop().create_future()

    async def _deliver(self, events: list[UsageEvent]) -> None:
        try:
            await self._sink.write(events)
        except Exception as exc:  # any database failure: keep the events durably instead
            self._next_retry = time.monotonic() + self._retry_interval_s
            if await self._spool_or_hold(events):
                log.warning("usage_spooled", events=len(events), error=type(exc).__name__)

    async def _spool_or_hold(self, events: list[UsageEvent]) -> bool:
        """Append ``events`` to the spool; when that fails too, hold them for a retry."""
        try:
            await asyncio.to_thread(self._spool.append, events)
        except OSError as exc:
            self._held.extend(events)
            self._next_retry = time.monotonic() + self._retry_interval_s
            log.error("usage_spool_failed", held=len(self._held), error=repr(exc))
            return False
        return True

    async def _rescue(self) -> None:
        """Store the held events: in the database if it is back, else in the spool."""
        if not self._held:
            return
        held, self._held = self._held, []
        try:
            await self._write_batches(held)
        except Exception:
            if not await self._spool_or_hold(held):
                return
        log.info("usage_rescued", events=len(held))

    async def _write_batches(self, events: list[UsageEvent]) -> None:
        for start in range(0, len(events), self._batch_size):
            await self._sink.write(events[start : start + self._batch_size])

    async def _replay(self) -> None:
        if self._spool.is_empty:
            return
        events = await asyncio.to_thread(self._spool.read)
        try:
            await self._write_batches(events)
        except Exception as exc:
            self._next_retry = time.monotonic() + self._retry_interval_s
            log.warning("usage_replay_failed", events=len(events), error=type(exc).__name__)
            return
        await asyncio.to_thread(self._spool.clear)
        log.info("usage_replayed", events=len(events))
