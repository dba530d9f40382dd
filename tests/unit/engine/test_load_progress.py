"""Start-up progress: rich bars on a terminal, JSON events elsewhere (never silent for long)."""

from __future__ import annotations

import io
import json
import sys
import threading
import time

import pytest
from rich.console import Console
from structlog.testing import capture_logs

from engine.load_progress import LogProgress, RichProgress, progress_for


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_events_per_stage_with_amounts_and_elapsed_time() -> None:
    progress = LogProgress(interval_s=0.0)  # every advance logs
    with capture_logs() as events:
        progress.stage("compile kernels", total=2, unit="kernels")
        progress.advance()
        progress.advance()
        progress.stage("read weights", total=3 * 2**20, unit="bytes")
        progress.advance(2**20)
        progress.close()
        progress.close()  # idempotent
    assert [(e["event"], e["stage"], e["done"]) for e in events] == [
        ("load_stage_started", "compile kernels", 0),
        ("load_progress", "compile kernels", 1),
        ("load_progress", "compile kernels", 2),
        ("load_stage_finished", "compile kernels", 2),
        ("load_stage_started", "read weights", 0),
        ("load_progress", "read weights", 2**20),
        ("load_stage_finished", "read weights", 2**20),
    ]
    assert {e["total"] for e in events if e["stage"] == "read weights"} == {3 * 2**20}
    assert all(e["elapsed_s"] >= 0 for e in events)


def test_progress_events_are_throttled() -> None:
    progress = LogProgress(interval_s=3600.0)
    with capture_logs() as events:
        progress.stage("read weights", total=1000, unit="bytes")
        for _ in range(1000):
            progress.advance()
        progress.close()
    assert [e["event"] for e in events] == ["load_stage_started", "load_stage_finished"]
    assert events[-1]["done"] == 1000


def test_a_stage_that_does_not_advance_still_reports_every_interval() -> None:
    # A weight whose packing takes seconds: the ticker repeats where the stage stands.
    progress = LogProgress(interval_s=0.05)
    with capture_logs() as events:
        progress.stage("pack weights", total=3, unit="weights")
        deadline = time.monotonic() + 30
        while sum(e["event"] == "load_progress" for e in events) < 3:
            assert time.monotonic() < deadline, events
            threading.Event().wait(0.01)
        progress.advance(3)
        progress.close()
        after_close = len(events)
    ticks = [e for e in events if e["event"] == "load_progress"]
    assert all((e["stage"], e["total"], e["unit"]) == ("pack weights", 3, "weights") for e in ticks)
    elapsed = [e["elapsed_s"] for e in ticks]
    assert elapsed == sorted(elapsed) and elapsed[0] >= 0.05
    assert events[-1]["event"] == "load_stage_finished" and events[-1]["done"] == 3
    assert not any(t.name == "atrium-load" for t in threading.enumerate())  # the ticker stopped
    assert len(events) == after_close


def test_log_lines_written_meanwhile_go_above_the_bars_whole() -> None:
    console = Console(file=io.StringIO(), force_terminal=True, width=40, record=True)
    progress = RichProgress(console)
    stderr = sys.stderr
    progress.stage("read weights", total=10 * 2**20, unit="bytes")
    line = json.dumps({"event": "kv_cache_sized", "num_pages": 11702, "note": "x" * 60})
    sys.stderr.write(line[:20])  # a line written in pieces is printed once it ends
    sys.stderr.write(line[20:] + "\n")
    progress.advance(10 * 2**20)
    progress.close()
    assert sys.stderr is stderr
    lines = console.export_text().splitlines()
    # One line, longer than the terminal: not wrapped, not cut (the export keeps what the bars
    # drew before the cursor went back over them).
    assert any(text.endswith(line) for text in lines), lines
    assert any("read weights" in text and "10.0 MiB / 10.0 MiB" in text for text in lines)


def test_terminal_bars_show_stage_amount_and_elapsed() -> None:
    console = Console(file=io.StringIO(), force_terminal=True, width=100, record=True)
    progress = RichProgress(console)
    progress.stage("compile kernels", total=3, unit="kernels")
    for _ in range(3):
        progress.advance()
    progress.stage("read weights", total=4 * 2**20, unit="bytes")
    progress.advance(2**20)  # the stage's end fills the bar: what is left was headers
    progress.stage("warm up kernels", unit="timed steps")  # size unknown: a spinner
    progress.advance(5)
    progress.stage("warm up", unit="steps")  # nothing counted: only the time shows
    progress.close()
    text = console.export_text()
    lines = [line for line in text.splitlines() if line.strip()]
    assert any("compile kernels" in line and "3/3 kernels" in line for line in lines), text
    assert any("read weights" in line and "4.0 MiB / 4.0 MiB" in line for line in lines), text
    assert any("warm up kernels" in line and "5/5 timed steps" in line for line in lines), text
    assert any("warm up " in line and "steps" not in line for line in lines), text
    assert all("0:00:0" in line for line in lines if "done" in line), text


@pytest.mark.parametrize(("stream", "kind"), [(Tty(), RichProgress), (io.StringIO(), LogProgress)])
def test_bars_only_on_a_terminal(stream: io.StringIO, kind: type) -> None:
    assert isinstance(progress_for(stream), kind)
