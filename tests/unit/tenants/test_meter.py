"""The usage meter when neither the database nor the spool takes an event, and one meter a spool."""

from __future__ import annotations

import asyncio
import errno
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path

import pytest

from tenants.errors import SpoolInUseError
from tenants.meter import UsageMeter
from tenants.records import UsageEvent
from tenants.spool import Spool


async def _until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "not reached in time"
        await asyncio.sleep(0.01)


def _event(n: int) -> UsageEvent:
    at = datetime(2030, 1, 1, tzinfo=UTC)
    return UsageEvent(
        request_id=f"r{n}",
        tenant_id="t",
        key_id=None,
        model="m",
        prompt_tokens=n,
        cached_tokens=0,
        completion_tokens=1,
        status="ok",
        started_at=at,
        finished_at=at,
    )


class Store:
    """A database that can be switched off; rows keyed by request id, as the real table is."""

    def __init__(self) -> None:
        self.up = True
        self.rows: dict[str, UsageEvent] = {}
        self.inserts = 0

    async def write(self, events: Sequence[UsageEvent]) -> int:
        if not self.up:
            raise ConnectionError("database unreachable")
        for event in events:
            self.inserts += 1
            self.rows.setdefault(event.request_id, event)
        return len(events)


@pytest.fixture
def full_disk(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """``full_disk[0] = True`` makes every spool append fail as a full disk does."""
    state = [False]
    append = Spool.append

    def failing(self: Spool, events: Sequence[UsageEvent]) -> None:
        if state[0]:
            raise OSError(errno.ENOSPC, "No space left on device")
        append(self, events)

    monkeypatch.setattr(Spool, "append", failing)
    return state


def test_a_failing_spool_holds_events_and_the_meter_recovers_with_the_disk(
    tmp_path: Path, full_disk: list[bool]
) -> None:
    store = Store()

    async def body() -> None:
        meter = UsageMeter(store, tmp_path / "usage.spool", retry_interval_s=0.05)
        await meter.start()
        store.up = False
        full_disk[0] = True
        meter.record(_event(1))
        meter.record(_event(2))
        await meter.flush()
        assert meter.held == 2 and not meter.healthy  # kept, and not ready
        meter.record(_event(3))  # the writer is still running
        await meter.flush()
        assert meter.held == 3 and not meter.spooled
        await asyncio.sleep(0.2)  # retries fail while the disk is full: nothing dropped
        assert meter.held == 3 and not meter.healthy

        full_disk[0] = False  # the disk has room again; the database is still down
        await _until(lambda: meter.healthy and meter.held == 0 and meter.spooled)  # a retry spools
        assert meter.healthy and meter.held == 0 and meter.spooled
        assert store.rows == {}

        store.up = True
        meter.record(_event(4))
        await meter.flush()
        assert not meter.spooled
        await meter.close()

    asyncio.run(body())
    assert sorted(store.rows) == ["r1", "r2", "r3", "r4"]


def test_held_events_go_straight_to_the_database_when_it_returns_first(
    tmp_path: Path, full_disk: list[bool]
) -> None:
    store = Store()

    async def body() -> None:
        meter = UsageMeter(store, tmp_path / "usage.spool", retry_interval_s=0.05)
        await meter.start()
        store.up = False
        full_disk[0] = True
        meter.record(_event(1))
        await meter.flush()
        assert not meter.healthy
        store.up = True
        await meter.flush()  # a flush retries at once
        assert meter.healthy and not meter.spooled
        await meter.close()

    asyncio.run(body())
    assert list(store.rows) == ["r1"]


def test_a_second_meter_on_the_same_spool_is_refused_until_the_first_closes(
    tmp_path: Path,
) -> None:
    path = tmp_path / "usage.spool"

    async def body() -> None:
        first = UsageMeter(Store(), path)
        await first.start()
        second = UsageMeter(Store(), path)
        with pytest.raises(SpoolInUseError, match="ATRIUM_USAGE_SPOOL_PATH"):
            await second.start()
        await first.close()
        await second.start()
        await second.close()

    asyncio.run(body())
