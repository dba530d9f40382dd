"""A durable local spool of usage events (JSON lines, fsync'd) for when the database is down."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import msgspec

from tenants.records import UsageEvent


class Spool:
    """Append-only file of events; blocking I/O (call it off the event loop)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._encoder = msgspec.json.Encoder()
        self._decoder = msgspec.json.Decoder(UsageEvent)

    def append(self, events: Sequence[UsageEvent]) -> None:
        if not events:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        data = b"".join(self._encoder.encode(event) + b"\n" for event in events)
        with self.path.open("ab") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())

    def read(self) -> list[UsageEvent]:
        """Every complete event; a torn last line (a crash mid-write) is skipped."""
        if not self.path.exists():
            return []
        events = []
        for line in self.path.read_bytes().splitlines():
            if not line.strip():
                continue
            try:
                events.append(self._decoder.decode(line))
            except msgspec.DecodeError:
                continue
        return events

    def clear(self) -> None:
        """Forget the spooled events (only once they are stored in the database)."""
        self.path.unlink(missing_ok=True)

    def __len__(self) -> int:
        return len(self.read())

    @property
    def is_empty(self) -> bool:
        return not self.path.exists() or self.path.stat().st_size == 0
