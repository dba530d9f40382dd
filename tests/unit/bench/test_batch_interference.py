"""bench.batch_interference: the side-by-side TTFT comparison and its batch input file."""

from __future__ import annotations

import json

import pytest

from bench.batch_interference import batch_file, compare
from bench.metrics import RequestRecord


def _record(ttft: float) -> RequestRecord:
    times = [ttft, ttft + 0.1]
    return RequestRecord("online", 0.0, times, done_at=ttft + 0.1, prompt_tokens=10)


def test_the_p99_ratio_compares_the_runs_and_judges_the_goal() -> None:
    alone = [_record(0.1) for _ in range(90)] + [_record(0.2) for _ in range(10)]
    slower = [_record(0.1) for _ in range(90)] + [_record(0.5) for _ in range(10)]
    result = compare(alone, slower)
    assert result["ttft_p99_ratio"] == pytest.approx(2.5)
    assert result["ttft_p50_ratio"] == pytest.approx(1.0)
    assert result["within_goal"] is False
    assert compare(alone, alone)["within_goal"] is True
    failed = RequestRecord("online", 0.0, error="HTTP 503")
    assert compare(alone, [failed])["within_goal"] is False  # no answer is no latency


def test_the_batch_file_is_one_chat_request_per_line() -> None:
    lines = batch_file("m", 3, 16).decode().splitlines()
    rows = [json.loads(line) for line in lines]
    assert [r["custom_id"] for r in rows] == ["line-0", "line-1", "line-2"]
    assert {r["url"] for r in rows} == {"/v1/chat/completions"}
    assert rows[2]["body"]["max_tokens"] == 16 and rows[2]["body"]["model"] == "m"
