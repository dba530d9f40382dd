"""Percentiles, per-request timings, objectives met, Jain's index and per-tenant shares on
synthetic timings."""

from __future__ import annotations

import math

import pytest

from bench.metrics import (
    RequestRecord,
    Slo,
    attainment,
    backlogged_shares,
    highest_sustained_rate,
    jain_index,
    latency_summary,
    percentile,
    service_over_time,
    summarize,
)


def test_percentile_interpolates_between_order_statistics() -> None:
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 4.0
    assert percentile(values, 50) == pytest.approx(2.5)
    assert percentile(list(range(101)), 99) == pytest.approx(99.0)
    assert percentile(list(map(float, range(1, 11))), 90) == pytest.approx(9.1)


def test_percentile_of_nothing_is_nan_and_bad_q_raises() -> None:
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_summarize_gives_mean_and_percentiles() -> None:
    out = summarize([1.0, 2.0, 3.0])
    assert out["mean"] == pytest.approx(2.0)
    assert out["p50"] == pytest.approx(2.0)
    assert out["p99"] == pytest.approx(2.98)


def test_jain_index_is_one_when_equal_and_one_over_n_when_one_takes_all() -> None:
    assert jain_index([5.0, 5.0, 5.0, 5.0]) == pytest.approx(1.0)
    assert jain_index([1.0, 0.0, 0.0, 0.0]) == pytest.approx(0.25)
    assert jain_index([3.0, 1.0]) == pytest.approx(16 / 20)
    assert jain_index([0.0, 0.0]) == 1.0


def test_ttft_tpot_and_itl_from_event_times() -> None:
    record = RequestRecord("a", sent_at=10.0, token_times=[10.5, 10.6, 10.8, 11.1])
    record.completion_tokens = 4
    record.done_at = 11.2
    assert record.ttft == pytest.approx(0.5)
    assert record.tpot == pytest.approx(0.6 / 3)
    assert record.itls == pytest.approx([0.1, 0.2, 0.3])
    assert record.latency == pytest.approx(1.2)


def test_single_token_answer_has_no_tpot_and_failed_request_is_not_ok() -> None:
    one = RequestRecord("a", 0.0, [0.2], completion_tokens=1)
    assert math.isnan(one.tpot)
    failed = RequestRecord("a", 0.0, error="HTTP 500")
    assert not failed.ok
    assert math.isnan(failed.ttft)


def test_latency_summary_counts_only_successful_requests() -> None:
    good = RequestRecord("a", 0.0, [1.0, 2.0], 2.0, 100, 60, 2)
    late = RequestRecord("b", 1.0, [2.0, 4.0], 4.0, 100, 0, 2)
    bad = RequestRecord("b", 0.5, done_at=0.6, error="HTTP 429: quota")
    out = latency_summary([good, late, bad])
    assert out["num_requests"] == 3
    assert out["num_errors"] == 1
    assert out["errors"] == ["HTTP 429: quota"]
    assert out["duration_s"] == pytest.approx(4.0)
    assert out["output_tok_s"] == pytest.approx(1.0)
    assert out["cached_fraction"] == pytest.approx(0.3)
    assert out["ttft_s"]["p50"] == pytest.approx(1.0)  # type: ignore[index]


def test_backlogged_shares_only_count_tokens_while_every_tenant_waits() -> None:
    # Tenant a runs alone from 0 to 2 (its 2 tokens there do not count), then both are
    # backlogged from 2 to 6: a gets 3 tokens, b gets 1.
    a = RequestRecord("a", 0.0, [1.0, 1.5, 3.0, 4.0, 5.0, 7.0], done_at=8.0)
    b = RequestRecord("b", 2.0, [5.5], done_at=6.0)
    shares = backlogged_shares([a, b])
    assert shares == pytest.approx({"a": 0.75, "b": 0.25})
    assert jain_index(shares.values()) == pytest.approx(1 / (2 * (0.75**2 + 0.25**2)))


def test_backlogged_shares_of_an_absent_tenant_are_zero() -> None:
    a = RequestRecord("a", 0.0, [1.0], done_at=1.0)
    assert backlogged_shares([a], tenants=["a", "b"]) == {"a": 0.0, "b": 0.0}


def test_service_over_time_bins_tokens_per_tenant() -> None:
    a = RequestRecord("a", 0.0, [0.1, 0.2, 1.5], done_at=1.5)
    b = RequestRecord("b", 0.5, [2.5], done_at=2.5)
    times, tokens = service_over_time([a, b], 1.0)
    assert times == [0.0, 1.0, 2.0]
    assert tokens == {"a": [2, 1, 0], "b": [0, 0, 1]}
    with pytest.raises(ValueError):
        service_over_time([a], 0.0)


def answer(ttft: float, tpot: float, tokens: int, error: str | None = None) -> RequestRecord:
    """A request sent at 0 whose ``tokens`` tokens arrive one per chunk."""
    times = [ttft + i * tpot for i in range(tokens)]
    return RequestRecord("a", 0.0, times, times[-1], 10, 0, tokens, error)


def test_a_request_meets_an_slo_only_within_both_limits() -> None:
    slo = Slo(ttft_s=2.0, tpot_s=0.2)
    assert slo.name == "ttft2s_tpot200ms" and Slo(1.0, 0.1).name == "ttft1s_tpot100ms"
    assert slo.met_by(answer(2.0, 0.2, 50))  # both limits are inclusive
    assert not slo.met_by(answer(2.01, 0.05, 50))  # first token late
    assert not slo.met_by(answer(0.1, 0.21, 50))  # the rest too slow
    # One token: nothing after the first to be slow, only TTFT counts.
    assert slo.met_by(answer(1.5, 0.0, 1)) and not slo.met_by(answer(2.5, 0.0, 1))
    # Failed or cut off at the deadline: missed whatever had arrived in time.
    assert not slo.met_by(answer(0.1, 0.01, 20, error="deadline: cut off"))
    assert not slo.met_by(RequestRecord("a", 0.0, error="HTTP 500"))


def test_attainment_is_the_fraction_meeting_with_errors_in_the_count() -> None:
    slo = Slo(1.0, 0.1)
    records = [answer(0.5, 0.05, 10)] * 7 + [answer(1.5, 0.05, 10), answer(0.5, 0.5, 10)]
    records.append(RequestRecord("a", 0.0, error="HTTP 429"))
    assert attainment(records, slo) == pytest.approx(0.7)
    assert attainment(records, Slo(2.0, 1.0)) == pytest.approx(0.9)
    assert math.isnan(attainment([], slo))


def test_the_highest_sustained_rate_stops_at_the_first_rate_that_fails() -> None:
    # Given out of order; 3.0 passing above a failed 2.0 is noise, not capacity.
    by_rate = {3.0: 0.95, 0.5: 1.0, 2.0: 0.85, 1.0: 0.92}
    assert highest_sustained_rate(by_rate, 0.9) == 1.0
    assert highest_sustained_rate(by_rate, 0.8) == 3.0
    assert highest_sustained_rate(by_rate, 0.99) == 0.5
    assert highest_sustained_rate({0.5: 0.6, 1.0: 0.95}, 0.9) is None
    assert highest_sustained_rate({0.5: math.nan, 1.0: 1.0}, 0.9) is None  # nothing sent
    assert highest_sustained_rate({}, 0.9) is None
