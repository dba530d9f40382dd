"""Start-up progress (kernel builds, weight reading, warm-up): rich bars on a terminal, JSON
``load_progress`` events otherwise. Loaders take a ``LoadProgress``; ``NullProgress`` is silent.
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Protocol, TextIO

import structlog

if TYPE_CHECKING:
    from rich.console import Console

log = structlog.get_logger("atrium.load")
EVENT_INTERVAL_S = 0.5  # the most often a stage logs its progress (its start and end always do)


class LoadProgress(Protocol):
    def stage(self, name: str, total: float | None = None, unit: str = "steps") -> None:
        """Start stage ``name`` (``total`` None: unknown size); the previous one ends."""
        ...

    def advance(self, amount: float = 1.0) -> None:
        """``amount`` more of the current stage's unit is done."""
        ...

    def close(self) -> None:
        """End the last stage and the display (idempotent)."""
        ...


class NullProgress:
    def stage(self, name: str, total: float | None = None, unit: str = "steps") -> None:
        pass

    def advance(self, amount: float = 1.0) -> None:
        pass

    def close(self) -> None:
        pass


class LogProgress:
    """One ``load_stage_started``, throttled ``load_progress`` and one ``load_stage_finished``
    event per stage, each with ``stage``, ``done``, ``total``, ``unit`` and ``elapsed_s``."""

    def __init__(self, interval_s: float = EVENT_INTERVAL_S) -> None:
        self._interval_s = interval_s
        self._name: str | None = None
        self._total: float | None = None
        self._unit = "steps"
        self._done = 0.0
        self._started = self._logged = 0.0

    def stage(self, name: str, total: float | None = None, unit: str = "steps") -> None:
        self.close()
        self._name, self._total, self._unit, self._done = name, total, unit, 0.0
        self._started = self._logged = time.monotonic()
        log.info("load_stage_started", **self._fields(self._started))

    def advance(self, amount: float = 1.0) -> None:
        if self._name is None:
            return
        self._done += amount
        now = time.monotonic()
        if now - self._logged >= self._interval_s:
            self._logged = now
            log.info("load_progress", **self._fields(now))

    def close(self) -> None:
        if self._name is not None:
            log.info("load_stage_finished", **self._fields(time.monotonic()))
            self._name = None

    def _fields(self, now: float) -> dict[str, object]:
        return {
            "stage": self._name,
            "done": _number(self._done),
            "total": None if self._total is None else _number(self._total),
            "unit": self._unit,
            "elapsed_s": round(now - self._started, 3),
        }


class RichProgress:
    """A bar per stage (a spinner when its size is unknown) with the amount and elapsed time."""

    def __init__(self, console: Console) -> None:
        from rich.progress import (  # noqa: PLC0415 (lazy: rich only on a terminal, ~0.25 s)
            BarColumn,
            Progress,
            SpinnerColumn,
            TextColumn,
            TimeElapsedColumn,
        )

        self._progress = Progress(
            SpinnerColumn(finished_text="[green]done"),
            TextColumn("{task.description:<16}"),
            BarColumn(),
            TextColumn("{task.fields[amount]}"),
            TimeElapsedColumn(),
            console=console,
            transient=False,
        )
        self._task: object | None = None
        self._unit = "steps"

    def stage(self, name: str, total: float | None = None, unit: str = "steps") -> None:
        self._end_stage()
        if not self._progress.live.is_started:
            self._progress.start()
        self._unit = unit
        self._task = self._progress.add_task(name, total=total, amount=self._amount(0, total))

    def advance(self, amount: float = 1.0) -> None:
        if self._task is None:
            return
        task = self._progress.tasks[-1]
        done = task.completed + amount
        self._progress.update(task.id, completed=done, amount=self._amount(done, task.total))

    def _end_stage(self) -> None:
        if self._task is None:
            return
        task = self._progress.tasks[-1]
        total = task.total if task.total is not None else task.completed
        self._progress.update(
            task.id, total=total, completed=total, amount=self._amount(total, total)
        )
        self._progress.stop_task(task.id)
        self._task = None
        self._progress.refresh()

    def close(self) -> None:
        self._end_stage()
        if self._progress.live.is_started:
            self._progress.stop()

    def _amount(self, done: float, total: float | None) -> str:
        if not done and not total:  # a stage of unknown size that counts nothing
            return ""
        if self._unit == "bytes":
            shown = f"{done / 2**20:.1f} MiB"
            return shown if total is None else f"{shown} / {total / 2**20:.1f} MiB"
        shown = f"{_number(done)}"
        return (
            f"{shown} {self._unit}" if total is None else f"{shown}/{_number(total)} {self._unit}"
        )


def _number(value: float) -> int | float:
    return int(value) if float(value).is_integer() else round(value, 3)


def progress_for(stream: TextIO | None = None) -> LogProgress | RichProgress:
    """Bars where ``stream`` (stderr by default) is a terminal, JSON events elsewhere."""
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    if callable(isatty) and isatty():
        from rich.console import Console  # noqa: PLC0415 (lazy: rich only on a terminal)

        return RichProgress(Console(file=stream))
    return LogProgress()
