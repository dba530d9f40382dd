"""The durable spool: round trip, torn last line, clearing."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

from tenants.records import UsageEvent
from tenants.spool import Spool


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


def test_round_trip_skips_a_torn_tail_and_clears(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "sub" / "usage.spool")
    assert spool.is_empty and spool.read() == []
    spool.append([_event(1), _event(2)])
    spool.append([_event(3)])
    with spool.path.open("ab") as handle:
        handle.write(b'{"request_id": "r4", "tenant')  # a crash mid-write
    assert [e.request_id for e in spool.read()] == ["r1", "r2", "r3"]
    spool.clear()
    assert spool.is_empty
