"""Goodput on made-up latencies: who meets an objective, the share, the highest passing rate."""

from __future__ import annotations

import math

import pytest

from bench.goodput_metrics import (
    OBJECTIVES,
    Objective,
    goodput,
    goodput_rate,
    meets,
    rate_summary,
    share_meeting,
)
from bench.metrics import RequestRecord

LOOSE, TIGHT = OBJECTIVES


def record(ttft: float, tpot: float, tokens: int = 11, error: str | None = None) -> RequestRecord:
    """A request sent at 0 whose first token came at ``ttft`` and the rest ``tpot`` apart."""
    times = [ttft + i * tpot for i in range(tokens)]
    return RequestRecord("t0", 0.0, times, times[-1], completion_tokens=tokens, error=error)


def test_the_objectives_are_the_headline_pairs() -> None:
    assert (LOOSE.ttft_s, LOOSE.tpot_s) == (2.0, 0.2)
    assert (TIGHT.ttft_s, TIGHT.tpot_s) == (1.0, 0.1)


def test_a_request_meets_an_objective_only_within_both_bounds_and_without_error() -> None:
    assert meets(record(1.5, 0.15), LOOSE) and not meets(record(1.5, 0.15), TIGHT)
    assert not meets(record(2.5, 0.05), LOOSE)  # first token too late
    assert not meets(record(0.1, 0.25), LOOSE)  # tokens too slow
    assert meets(record(2.0, 0.2), LOOSE)  # on the bound counts
    assert not meets(record(0.1, 0.01, error="HTTP 500"), LOOSE)
    assert meets(record(0.5, 0.0, tokens=1), TIGHT)  # one token: no TPOT to miss


def test_the_share_counts_errors_against_and_the_summary_reports_percentiles() -> None:
    records = [record(0.5, 0.05)] * 6 + [record(1.5, 0.05)] * 2 + [record(3.0, 0.3)]
    records.append(record(0.1, 0.01, error="deadline"))
    assert share_meeting(records, LOOSE) == pytest.approx(0.8)
    assert share_meeting(records, TIGHT) == pytest.approx(0.6)
    assert math.isnan(share_meeting([], LOOSE))
    summary = rate_summary(records)
    assert summary["num_requests"] == 10 and summary["num_errors"] == 1
    assert summary["ttft_s"]["p50"] == pytest.approx(0.5)  # type: ignore[index]
    assert summary["meeting"] == {LOOSE.name: 0.8, TIGHT.name: 0.6}


def test_the_goodput_rate_is_the_highest_rate_passing_with_every_lower_one() -> None:
    assert goodput_rate({0.5: 1.0, 1.0: 0.95, 2.0: 0.9, 4.0: 0.5}) == 2.0
    # A rate passing above a failed one is noise, not capacity.
    assert goodput_rate({0.5: 1.0, 1.0: 0.7, 2.0: 0.92}) == 0.5
    assert goodput_rate({1.0: 0.89}) is None
    assert goodput_rate({1.0: math.nan}) is None


def test_goodput_of_a_sweep_per_objective() -> None:
    fast = [record(0.3, 0.05)] * 10
    middling = [record(1.5, 0.15)] * 10
    slow = [record(5.0, 0.5)] * 10
    result = goodput({1.0: fast, 2.0: middling, 4.0: slow})
    assert result == {LOOSE.name: 2.0, TIGHT.name: 1.0}
    assert Objective(2.0, 0.2).name == "ttft<=2s,tpot<=200ms"
