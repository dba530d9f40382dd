"""A request's one log line: written once, with its outcome read from how it ended."""

from __future__ import annotations

import pytest
from structlog.testing import capture_logs

from web.ops.request_log import RequestTrail


def test_the_first_ending_writes_the_only_line() -> None:
    trail = RequestTrail("req-1", "chat")
    trail.note(tenant="t1", key_id="key_1", model="m", batch_id=None)
    with capture_logs() as logs:
        trail.finished(
            status=200,
            outcome="ok",
            completion_id="chatcmpl-1",
            prompt_tokens=5,
            cached_tokens=0,
            completion_tokens=2,
            ttft_s=0.25,
            finish_reason="length",
        )
        trail.refused(429, "requests_per_minute")  # too late: the request has its line
    [line] = logs
    assert line["event"] == "request_done" and line["log_level"] == "info"
    assert (line["request_id"], line["tenant_id"], line["key_id"], line["model"]) == (
        "req-1",
        "t1",
        "key_1",
        "m",
    )
    assert (line["status"], line["outcome"], line["reason"]) == (200, "ok", None)
    assert line["ttft_s"] == 0.25 and line["duration_s"] >= 0


@pytest.mark.parametrize(
    ("status", "outcome", "level"),
    [
        (429, "refused", "info"),
        (401, "refused", "info"),
        (499, "disconnect", "info"),
        (503, "refused", "warning"),
        (500, "error", "warning"),
    ],
)
def test_an_early_end_is_named_by_its_status(status: int, outcome: str, level: str) -> None:
    with capture_logs() as logs:
        RequestTrail("req-2", "completion").refused(status, "why")
    [line] = logs
    assert (line["status"], line["outcome"], line["reason"], line["log_level"]) == (
        status,
        outcome,
        "why",
        level,
    )
    assert line["completion_tokens"] == 0 and line["ttft_s"] is None
