"""The durable spool: round trip, torn and corrupt records, clearing, one holder per file."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import msgspec
import pytest

from tenants.errors import SpoolInUseError
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


def _ids(spool: Spool) -> list[str]:
    return [event.request_id for event in spool.read()]


def test_round_trip_skips_a_torn_tail_and_clears(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "sub" / "usage.spool")
    assert spool.is_empty and spool.read() == []
    spool.append([_event(1), _event(2)])
    spool.append([_event(3)])
    with spool.path.open("ab") as handle:
        handle.write(b'{"request_id": "r4", "tenant')  # a crash mid-write
    assert _ids(spool) == ["r1", "r2", "r3"]
    spool.clear()
    assert spool.is_empty


def test_an_append_after_a_torn_tail_keeps_every_complete_record(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "usage.spool")
    spool.append([_event(1)])
    whole = spool.path.read_bytes()
    spool.append([_event(2)])
    # The crash cut the second append short: half a record, no newline.
    torn = spool.path.read_bytes()[: len(whole) + 20]
    spool.path.write_bytes(torn)
    spool.append([_event(3), _event(4)])  # the next process appends after the torn bytes
    assert _ids(spool) == ["r1", "r3", "r4"]
    spool.append([_event(5)])
    assert _ids(spool) == ["r1", "r3", "r4", "r5"]


def test_a_record_whose_bytes_changed_is_skipped_not_misread(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "usage.spool")
    spool.append([_event(1), _event(2), _event(3)])
    data = bytearray(spool.path.read_bytes())
    second = data.index(b'"r2"')
    data[second + 2] = ord("9")  # r2 -> r9 on disk: the checksum no longer matches
    spool.path.write_bytes(bytes(data))
    assert _ids(spool) == ["r1", "r3"]


def test_plain_json_lines_of_an_older_spool_are_still_replayed(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "usage.spool")
    spool.path.write_bytes(b'{"request_id": "r0", "tenant_id": "t", "model": "m"}\n')
    legacy = Spool(tmp_path / "old.spool")
    legacy.path.write_bytes(msgspec.json.encode(_event(7)) + b"\n")
    legacy.append([_event(8)])
    assert _ids(legacy) == ["r7", "r8"]
    assert spool.read() == []  # an incomplete legacy record is skipped, not a crash


def test_a_second_holder_of_the_same_spool_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "shared" / "usage.spool"
    first = Spool(path)
    first.lock()
    second = Spool(path)
    with pytest.raises(SpoolInUseError, match="already in use"):
        second.lock()
    first.append([_event(1)])
    first.clear()  # clearing the records keeps the lock
    with pytest.raises(SpoolInUseError):
        Spool(path).lock()
    first.unlock()
    second.lock()  # free again once the first holder lets go
    second.unlock()
