"""The usage meter: exactly one row per request id through outages, spooling and replays."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import func, select

from tenants import Database
from tenants.errors import MeterClosedError
from tenants.meter import UsageMeter
from tenants.models import UsageEventRow
from tenants.records import UsageEvent
from tenants.usage_store import UsageStore


def _event(clock, n: int, tenant: str = "tn_a") -> UsageEvent:
    start = clock() + timedelta(minutes=n)
    return UsageEvent(
        request_id=f"req-{n}",
        tenant_id=tenant,
        key_id="key_1",
        model="m",
        prompt_tokens=10 + n,
        cached_tokens=n,
        completion_tokens=5,
        status="ok",
        started_at=start,
        finished_at=start + timedelta(seconds=2),
        ttft_ms=12.5,
        duration_ms=2000.0,
    )


async def _stored(domain, clock) -> tuple[int, int, int]:
    """(event rows, requests in rollups, prompt tokens in rollups)."""
    async with domain.db.sessions() as session:
        rows = await session.scalar(select(func.count()).select_from(UsageEventRow))
    buckets = await domain.reports.usage(clock() - timedelta(days=1), clock() + timedelta(days=1))
    return rows or 0, sum(b.requests for b in buckets), sum(b.prompt_tokens for b in buckets)


class FlakySink:
    """A store that can be switched off, like a database going away and coming back."""

    def __init__(self, store: UsageStore) -> None:
        self.store = store
        self.up = True

    async def write(self, events: Sequence[UsageEvent]) -> int:
        if not self.up:
            raise ConnectionError("database unreachable")
        return await self.store.write(events)


def test_unreachable_database_spools_and_a_later_process_replays_once(
    open_domain, clock, tmp_path: Path
) -> None:
    spool = tmp_path / "usage.spool"
    events = [_event(clock, n) for n in range(6)]

    async def outage() -> None:
        # Nothing listens on port 1: every write fails to connect, as in an outage. (A SQLite
        # file in a missing folder fails too, but aiosqlite then answers its own clean-up from a
        # worker thread that can outlive the event loop.)
        bad = await Database.connect("postgresql+asyncpg://atrium@127.0.0.1:1/absent")
        meter = UsageMeter(UsageStore(bad), spool, retry_interval_s=0.05)
        await meter.start()
        for event in events:
            meter.record(event)
        meter.record(events[0])  # a retried duplicate
        await meter.flush()
        assert meter.spooled
        await meter.close()
        await bad.close()

    async def recovery() -> None:
        async with open_domain(spool=spool) as domain:
            # As if an earlier replay stored two events and crashed before clearing the spool.
            await UsageStore(domain.db).write(events[:2])
            await domain.meter.start()
            await domain.meter.flush()
            assert not domain.meter.spooled
            expected_prompt = sum(e.prompt_tokens for e in events)
            assert await _stored(domain, clock) == (6, 6, expected_prompt)

    asyncio.run(outage())
    assert spool.exists()
    asyncio.run(recovery())
    assert not spool.exists()


def test_meter_recovers_in_place_without_losing_or_doubling(
    open_domain, clock, tmp_path: Path
) -> None:
    async def body() -> None:
        async with open_domain() as domain:
            sink = FlakySink(UsageStore(domain.db))
            meter = UsageMeter(sink, tmp_path / "inplace.spool", retry_interval_s=0.05)
            await meter.start()
            meter.record(_event(clock, 1))
            await meter.flush()
            sink.up = False
            for n in range(2, 5):
                meter.record(_event(clock, n))
            await meter.flush()
            assert meter.spooled
            assert (await _stored(domain, clock))[0] == 1
            sink.up = True
            meter.record(_event(clock, 5))
            meter.record(_event(clock, 3))  # already spooled once
            await meter.flush()
            assert not meter.spooled
            await meter.close()
            assert await _stored(domain, clock) == (5, 5, sum(10 + n for n in range(1, 6)))

    asyncio.run(body())


def test_a_spool_path_that_cannot_be_used_refuses_to_start(clock, tmp_path: Path) -> None:
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where the spool's folder should be")

    class DownSink:
        async def write(self, events: Sequence[UsageEvent]) -> None:
            raise OSError("database down")

    async def body() -> None:
        meter = UsageMeter(DownSink(), blocker / "usage.spool")
        with pytest.raises(OSError):
            await meter.start()
        with pytest.raises(MeterClosedError):
            await meter.flush()  # nothing runs, and flush says so at once

    asyncio.run(body())
