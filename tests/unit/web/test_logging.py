"""Log lines go to the stderr of the moment, even after the stream logging began with is gone."""

from __future__ import annotations

import io
import json
import sys

import pytest
import structlog

from bench.common import quiet_logging
from web.ops.logging import configure_logging


@pytest.mark.parametrize("configure", [configure_logging, quiet_logging])
def test_logs_follow_sys_stderr_after_the_configured_one_is_closed(
    configure: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    assert callable(configure)
    configure()
    first.close()  # as a test runner's capture stream is, once its test is over
    later = io.StringIO()
    monkeypatch.setattr(sys, "stderr", later)
    try:
        structlog.get_logger("a_logger_first_used_now").warning("still_logged", n=1)
    finally:
        structlog.reset_defaults()
    line = later.getvalue().strip().splitlines()[-1]
    assert "still_logged" in line
    if configure is configure_logging:
        assert json.loads(line)["n"] == 1
