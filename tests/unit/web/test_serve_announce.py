"""`atrium serve`'s ready line: where requests and the console go, as text on a terminal."""

from __future__ import annotations

import io
import json
import os
import re
import time
from pathlib import Path

import pytest

from web.cli.serve import announce, process_age_s
from web.ops.logging import configure_logging
from web.settings import Settings

START = time.monotonic()


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True

    def text(self) -> str:
        return re.sub(r"\x1b\[[0-9;]*m", "", self.getvalue())  # without the bold


def test_a_terminal_gets_one_line_with_both_addresses(monkeypatch: pytest.MonkeyPatch) -> None:
    stream = Tty()
    monkeypatch.setattr("sys.stderr", stream)
    announce(Settings.load({"host": "0.0.0.0"}, environ={}), 8123)
    [line] = stream.text().splitlines()
    assert "send requests to http://127.0.0.1:8123/v1" in line
    assert "the console is at http://127.0.0.1:8123/admin/" in line


def test_an_engine_has_no_console(monkeypatch: pytest.MonkeyPatch) -> None:
    stream = Tty()
    monkeypatch.setattr("sys.stderr", stream)
    settings = Settings.load({"role": "engine", "engine_token": "t" * 32}, environ={})
    announce(settings, 9000)
    assert "http://127.0.0.1:9000/v1" in stream.text()
    assert "console" not in stream.text()


def test_the_ready_event_says_how_long_the_start_took(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    configure_logging("info")
    announce(Settings.load({}, environ={}), 8000)
    event = json.loads(capsys.readouterr().err.strip().splitlines()[-1])
    assert event["event"] == "serve_ready"
    # Since this test process started: more than the time this test has run, and no more
    # than the process's age read after it.
    assert time.monotonic() - START < event["startup_s"] <= process_age_s()


def test_the_age_comes_from_the_kernels_record_of_the_process(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    now_ticks = int(time.clock_gettime(time.CLOCK_BOOTTIME) * os.sysconf("SC_CLK_TCK"))
    fields = ["S"] + ["0"] * 18 + [str(now_ticks - 12 * os.sysconf("SC_CLK_TCK"))] + ["0"] * 5
    stat.write_text(f"123 (python -m web.cli) {' '.join(fields)}\n")
    assert 11.9 <= process_age_s(stat) <= 12.5
    assert 0 <= process_age_s(tmp_path / "missing") < time.monotonic()  # since the import
