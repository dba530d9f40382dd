"""`atrium serve`'s ready line: where requests and the console go, as text on a terminal."""

from __future__ import annotations

import io
import re

import pytest

from web.cli.serve import announce
from web.settings import Settings


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
