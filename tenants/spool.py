"""A durable local spool of usage events (framed lines, fsync'd) for when the database is down.

Each record is one line ``<length> <crc32 hex> <json>``; a torn or damaged line is skipped on
read, and an append always starts on a fresh line, so no complete record is ever lost to one.
"""

from __future__ import annotations

import fcntl
import os
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import BinaryIO

import msgspec

from tenants.errors import SpoolInUseError
from tenants.records import UsageEvent


def frame(payload: bytes) -> bytes:
    """One record's line: its length and checksum say whether it was written whole."""
    return b"%d %08x %s\n" % (len(payload), zlib.crc32(payload), payload)


def unframe(line: bytes) -> bytes | None:
    """The payload of a whole record, or None for a torn or damaged one."""
    if line.startswith(b"{"):  # a plain JSON line of an older spool; the decoder checks it
        return line
    length, _, rest = line.partition(b" ")
    checksum, _, payload = rest.partition(b" ")
    if not length.isdigit() or len(checksum) != 8 or int(length) != len(payload):
        return None
    try:
        expected = int(checksum, 16)
    except ValueError:
        return None
    return payload if zlib.crc32(payload) == expected else None


class Spool:
    """Append-only file of events; blocking I/O (call it off the event loop).

    ``lock()`` takes an exclusive lock on ``<path>.lock`` for as long as the holder runs: two
    writers on one spool would interleave appends and clear each other's records.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lock_path = path.with_name(path.name + ".lock")
        self._lock_file: BinaryIO | None = None
        self._encoder = msgspec.json.Encoder()
        self._decoder = msgspec.json.Decoder(UsageEvent)

    def lock(self) -> None:
        """Hold the spool alone; SpoolInUseError when another process (or holder) has it."""
        if self._lock_file is not None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        handle = self.lock_path.open("a+b")
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read(32).decode("ascii", "replace").strip() or "unknown"
            handle.close()
            raise SpoolInUseError(
                f"the usage spool {self.path} is already in use (pid {holder}); "
                "give each gateway its own ATRIUM_USAGE_SPOOL_PATH"
            ) from None
        handle.truncate(0)
        handle.write(str(os.getpid()).encode("ascii"))
        handle.flush()
        self._lock_file = handle

    def unlock(self) -> None:
        if self._lock_file is not None:
            self._lock_file.close()  # closing the descriptor releases the flock
            self._lock_file = None

    def append(self, events: Sequence[UsageEvent]) -> None:
        if not events:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        data = b"".join(frame(self._encoder.encode(event)) for event in events)
        created = not self.path.exists()
        with self.path.open("a+b") as handle:
            end = handle.seek(0, os.SEEK_END)
            if end > 0:
                handle.seek(end - 1)
                if handle.read(1) != b"\n":
                    # A crash tore the last append: end its line so this one stays whole.
                    data = b"\n" + data
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        if created:
            _fsync_dir(self.path.parent)

    def read(self) -> list[UsageEvent]:
        """Every whole record in order; torn or damaged lines are skipped."""
        if not self.path.exists():
            return []
        events = []
        for line in self.path.read_bytes().split(b"\n"):
            payload = unframe(line)
            if payload is None:
                continue
            try:
                events.append(self._decoder.decode(payload))
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


def _fsync_dir(folder: Path) -> None:
    """Make a new file's directory entry durable too."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
