"""Live chart points: latency quantiles from bucket differences, rates, refusals by reason."""

from __future__ import annotations

import math
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram

from engine.stats import EngineSnapshot, EngineStats
from radix_cache.stats import NamespaceSnapshot
from web.admin.live_metrics import (
    HISTORY_S,
    ITL_FAMILY,
    LATENCY_WINDOW_S,
    REQUESTS_FAMILY,
    TTFT_FAMILY,
    LiveHistory,
    missing,
    quantile,
    read,
)
from web.ops.metrics import LATENCY_BUCKETS


class Latencies:
    """A registry with the gateway's two latency histograms and no refusal counter."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.ttft = Histogram(TTFT_FAMILY, "TTFT", buckets=LATENCY_BUCKETS, registry=self.registry)
        self.itl = Histogram(ITL_FAMILY, "ITL", buckets=LATENCY_BUCKETS, registry=self.registry)


def cache(pages: int) -> NamespaceSnapshot:
    return NamespaceSnapshot("", pages, 0, None, 1.0, None, 0, 0, 0, 0, 0)


def snapshot(prefill: int, generated: int) -> EngineSnapshot:
    return EngineSnapshot(
        running_by_tenant={"t1": 2},
        waiting_by_tenant={"t2": 3},
        num_pages_total=100,
        num_pages_free=60,
        counters=EngineStats(num_prefill_tokens=prefill, num_generated_tokens=generated),
        cache_by_namespace={"tenant:t1": cache(7), "public": cache(5)},
    )


def test_quantile_interpolates_inside_the_bucket_of_its_rank() -> None:
    later = {0.1: 50.0, 0.2: 90.0, 0.5: 100.0, math.inf: 100.0}
    assert quantile(0.5, later, None) == pytest.approx(0.1)
    assert quantile(0.7, later, None) == pytest.approx(0.15)
    assert quantile(0.99, later, None) == pytest.approx(0.2 + 0.3 * 0.9)


def test_quantile_counts_only_what_happened_between_two_readings() -> None:
    earlier = {0.1: 100.0, 1.0: 100.0, math.inf: 100.0}
    later = {0.1: 100.0, 1.0: 110.0, math.inf: 110.0}  # ten new observations, all slow
    assert quantile(0.5, later, earlier) == pytest.approx(0.55)
    assert quantile(0.5, earlier, earlier) is None  # nothing new: no value, not zero


def test_quantile_past_the_last_bound_is_that_bound() -> None:
    assert quantile(0.99, {1.0: 1.0, math.inf: 10.0}, None) == 1.0


def test_points_measure_tokens_per_second_and_latency_between_readings() -> None:
    metrics = Latencies()
    history = LiveHistory()
    first = read(metrics.registry, snapshot(prefill=100, generated=10))
    history.add(first)
    assert history.since(None) == []  # one reading has no rate yet
    for seconds in (0.2, 0.2, 0.2):
        metrics.ttft.observe(seconds)
    metrics.itl.observe(0.04)
    second = replace(read(metrics.registry, snapshot(600, 50)), at=first.at + 2.0)
    history.add(second)
    [point] = history.since(None)
    assert point.prompt_tokens_per_s == pytest.approx(250.0)
    assert point.generated_tokens_per_s == pytest.approx(20.0)
    assert 0.1 < point.ttft_p50_s <= 0.25 and 0.1 < point.ttft_p99_s <= 0.25  # type: ignore[operator]
    assert 0.025 < point.itl_p50_s <= 0.05  # type: ignore[operator]
    assert point.kv_pages_total == 100
    by_tenant = {t.tenant_id: (t.running, t.waiting, t.kv_pages) for t in point.tenants}
    assert by_tenant == {"t1": (2, 0, 7), "t2": (0, 3, 0)}  # the public namespace is no tenant
    assert point.refusals_per_min is None and missing(second) == ["refusals", "requests"]


def test_polls_closer_than_a_second_share_one_point() -> None:
    history = LiveHistory()
    first = read(None, snapshot(0, 0))
    history.add(first)
    history.add(replace(first, at=first.at + 0.3))
    history.add(replace(first, at=first.at + 1.5))
    assert len(history.since(None)) == 1
    assert history.since(history.since(None)[0].at) == []


def test_latency_covers_the_window_not_just_the_last_poll() -> None:
    metrics = Latencies()
    history = LiveHistory()
    start = read(metrics.registry, None)
    history.add(start)
    metrics.ttft.observe(2.0)
    history.add(replace(read(metrics.registry, None), at=start.at + 2))
    history.add(replace(read(metrics.registry, None), at=start.at + 4))  # nothing new since
    latest = history.since(None)[-1]
    assert latest.ttft_p50_s is not None and latest.ttft_p50_s > 1.0
    late = replace(read(metrics.registry, None), at=start.at + 4 + LATENCY_WINDOW_S + 1)
    history.add(late)
    assert history.since(None)[-1].ttft_p50_s is None  # the slow request left the window


def test_refusals_by_reason_from_any_refusal_counter() -> None:
    registry = CollectorRegistry()
    refusals = Counter(
        "atrium_refusals", "Refused requests", ["tenant", "reason"], registry=registry
    )
    refusals.labels("a", "quota").inc(2)
    history = LiveHistory()
    first = read(registry, None)
    history.add(first)
    refusals.labels("a", "quota").inc(3)
    refusals.labels("b", "quota").inc(1)
    refusals.labels("b", "overloaded").inc(6)
    later = replace(read(registry, None), at=first.at + 60)
    history.add(later)
    [point] = history.since(None)
    # Rates over (at + 60) - at, a float difference of two epoch times: not exactly 60.
    assert point.refusals_per_min == pytest.approx({"overloaded": 6.0, "quota": 4.0})
    assert missing(later) == ["engine", "ttft", "itl", "requests"]
    assert point.prompt_tokens_per_s is None and point.tenants == []


def test_a_restarted_engine_counter_gives_no_rate() -> None:
    history = LiveHistory()
    first = read(None, snapshot(1000, 100))
    history.add(first)
    history.add(replace(read(None, snapshot(10, 1)), at=first.at + 2))
    [point] = history.since(None)
    assert point.prompt_tokens_per_s is None and point.generated_tokens_per_s is None
    assert point.at <= datetime.now(UTC)


def test_refusals_are_named_by_status_and_reason() -> None:
    registry = CollectorRegistry()
    refusals = Counter("atrium_refusals", "Refused", ["status", "reason"], registry=registry)
    refusals.labels("429", "requests_per_minute").inc()
    refusals.labels("401", "invalid_api_key").inc(2)
    assert read(registry, None).refusals == {
        "429 requests_per_minute": 1.0,
        "401 invalid_api_key": 2.0,
    }


def test_requests_and_errors_per_second_by_status() -> None:
    registry = CollectorRegistry()
    requests = Counter(REQUESTS_FAMILY, "Requests", ["endpoint", "status"], registry=registry)
    history = LiveHistory()
    first = read(registry, None)
    history.add(first)
    requests.labels("chat", "ok").inc(8)
    requests.labels("completions", "ok").inc(2)
    requests.labels("chat", "disconnect").inc(4)  # the client left: no server error
    requests.labels("chat", "timeout").inc(2)
    requests.labels("chat", "error").inc(4)
    history.add(replace(read(registry, None), at=first.at + 2))
    [point] = history.since(None)
    assert point.requests_per_s == pytest.approx(10.0)
    assert point.errors_per_s == pytest.approx(3.0)


def test_history_keeps_the_last_hour_and_few_readings() -> None:
    """A point every two seconds for two hours: the points of the last hour stay, in order,
    and only the readings the latency window needs are kept."""
    history = LiveHistory()
    first = read(None, snapshot(0, 0))
    start = first.wall - timedelta(hours=2)
    for n in range(3601):
        at = start + timedelta(seconds=2 * n)
        history.add(replace(first, at=first.at + 2 * n, wall=at))
    points = history.since(None)
    assert points[-1].at == start + timedelta(seconds=7200)
    assert points[0].at >= points[-1].at - timedelta(seconds=HISTORY_S)
    assert len(points) == HISTORY_S / 2 + 1
    assert len(history.readings) <= LATENCY_WINDOW_S / 2 + 2
    middle = points[len(points) // 2].at
    assert [p.at for p in history.since(middle)] == [p.at for p in points if p.at > middle]
