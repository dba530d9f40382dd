"""Start-up progress (kernel builds, weight reading and packing, the KV cache, warm-up): rich bars
on a terminal, JSON ``load_*`` events otherwise. Loaders take a ``LoadProgress``; ``NullProgress``
is silent.

Off a terminal a stage is never silent for longer than ``EVENT_INTERVAL_S``: a ticker thread
repeats its ``load_progress`` line (done, total, elapsed) while a long piece of work runs. On a
terminal, log lines written to stderr while the bars are drawn go above them, one whole line
each (rich's own redirection would wrap a JSON line at the terminal's width).
"""

from __future__ import annotations

import io
import sys
import threading
import time
from typing import TYPE_CHECKING, Protocol, TextIO

import structlog

if TYPE_CHECKING:
    from rich.console import Console

log = structlog.get_logger("atrium.load")
EVENT_INTERVAL_S = 1.0  # the most time between two events of a stage off a terminal
TICKS_PER_INTERVAL = 4  # how often the ticker looks, per interval


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
    """One ``load_stage_started``, a ``load_progress`` at least every ``interval_s`` (on an
    advance, or from the ticker while nothing advances) and one ``load_stage_finished`` event
    per stage, each with ``stage``, ``done``, ``total``, ``unit`` and ``elapsed_s``.
    ``interval_s`` 0 logs every advance and starts no ticker."""

    def __init__(self, interval_s: float = EVENT_INTERVAL_S) -> None:
        self._interval_s = interval_s
        self._lock = threading.Lock()  # the stage's fields, between the caller and the ticker
        self._name: str | None = None
        self._total: float | None = None
        self._unit = "steps"
        self._done = 0.0
        self._started = self._logged = 0.0
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None

    def stage(self, name: str, total: float | None = None, unit: str = "steps") -> None:
        with self._lock:
            self._finish()
            self._name, self._total, self._unit, self._done = name, total, unit, 0.0
            self._started = self._logged = time.monotonic()
            log.info("load_stage_started", **self._fields(self._started))
        if self._ticker is None and self._interval_s > 0:
            self._stop.clear()
            self._ticker = threading.Thread(target=self._tick, name="atrium-load", daemon=True)
            self._ticker.start()

    def advance(self, amount: float = 1.0) -> None:
        with self._lock:
            if self._name is None:
                return
            self._done += amount
            now = time.monotonic()
            if now - self._logged >= self._interval_s:
                self._log_progress(now)

    def close(self) -> None:
        with self._lock:
            self._finish()
        ticker, self._ticker = self._ticker, None
        if ticker is not None:
            self._stop.set()
            ticker.join()

    def _tick(self) -> None:
        while not self._stop.wait(self._interval_s / TICKS_PER_INTERVAL):
            with self._lock:
                now = time.monotonic()
                if self._name is not None and now - self._logged >= self._interval_s:
                    self._log_progress(now)

    def _log_progress(self, now: float) -> None:
        self._logged = now
        log.info("load_progress", **self._fields(now))

    def _finish(self) -> None:
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


class LinesAbove(io.TextIOBase):
    """A stand-in for ``sys.stderr`` while bars are drawn: each complete line is printed above
    them as it is (no markup, no wrapping); a partial line waits for its end."""

    def __init__(self, console: Console, stream: TextIO) -> None:
        self._console = console
        self._stream = stream
        self._partial = ""
        self._lock = threading.Lock()  # threads of this process log while the bars draw

    def write(self, text: str) -> int:
        with self._lock:
            *lines, self._partial = (self._partial + text).split("\n")
        for line in lines:
            self._console.print(
                line, markup=False, highlight=False, emoji=False, soft_wrap=True, end="\n"
            )
        return len(text)

    def flush(self) -> None:
        if self._partial:
            self.write("\n")

    def isatty(self) -> bool:
        return self._stream.isatty()

    def fileno(self) -> int:
        return self._stream.fileno()


class RichProgress:
    """A bar per stage (a spinner when its size is unknown) with the amount and elapsed time;
    what is written to ``sys.stderr`` meanwhile goes above the bars."""

    def __init__(self, console: Console) -> None:
        from rich.progress import (  # noqa: PLC0415 (lazy: rich only on a terminal, ~0.25 s)
            BarColumn,
            Progress,
            SpinnerColumn,
            TextColumn,
            TimeElapsedColumn,
        )

        self._console = console
        self._progress = Progress(
            SpinnerColumn(finished_text="[green]done"),
            TextColumn("{task.description:<18}"),
            BarColumn(),
            TextColumn("{task.fields[amount]}"),
            TimeElapsedColumn(),
            console=console,
            transient=False,
            redirect_stdout=False,  # stdout may carry data (``generate``'s completion)
            redirect_stderr=False,  # ``LinesAbove`` instead: whole lines
        )
        self._task: object | None = None
        self._unit = "steps"
        self._stderr: TextIO | None = None  # the stream ``LinesAbove`` stands in for

    def stage(self, name: str, total: float | None = None, unit: str = "steps") -> None:
        self._end_stage()
        if not self._progress.live.is_started:
            self._progress.start()
            self._stderr, sys.stderr = sys.stderr, LinesAbove(self._console, sys.stderr)
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
            if self._stderr is not None:
                sys.stderr.flush()
                sys.stderr, self._stderr = self._stderr, None
            self._progress.stop()

    def _amount(self, done: float, total: float | None) -> str:
        if not done and not total:  # a stage of unknown size that counts nothing
            return ""
        if self._unit == "bytes":
            scale, suffix = (2**30, "GiB") if (total or done) >= 2**30 else (2**20, "MiB")
            shown = f"{done / scale:.1f} {suffix}"
            return shown if total is None else f"{shown} / {total / scale:.1f} {suffix}"
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
