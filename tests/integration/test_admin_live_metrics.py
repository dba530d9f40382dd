"""GET /admin/v1/metrics/live: the console's chart points from the registry and the engine."""

from __future__ import annotations

import itertools
import time
from datetime import UTC, datetime

import pytest
from litestar import Litestar
from litestar.testing import TestClient
from prometheus_client import CollectorRegistry, Counter, Histogram

from engine.stats import EngineSnapshot, EngineStats
from tests.integration.test_admin_app import (
    ADMIN_TOKEN,
    admin,
    anon,
    assert_error,
    build_admin_app,
    db_url,
)
from web.admin.live_metrics import ITL_FAMILY, MIN_INTERVAL_S, REQUESTS_FAMILY, TTFT_FAMILY
from web.ops.metrics import LATENCY_BUCKETS

__all__ = ["admin", "anon", "db_url"]  # fixtures used below
Client = TestClient[Litestar]


class Metrics:
    """A gateway registry with finished requests, the two latency histograms and no refusal
    counter."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            REQUESTS_FAMILY, "Requests", ["endpoint", "status"], registry=self.registry
        )
        self.ttft = Histogram(TTFT_FAMILY, "TTFT", buckets=LATENCY_BUCKETS, registry=self.registry)
        self.itl = Histogram(ITL_FAMILY, "ITL", buckets=LATENCY_BUCKETS, registry=self.registry)

    def count_refusal(self, status: int, reason: str) -> None:
        """What the error handler calls; this server does not count refusals."""


class CountingEngine:
    """An engine whose counters grow by 1,000 prompt and 100 generated tokens per report."""

    def __init__(self) -> None:
        self.calls = 0

    def stats(self) -> EngineSnapshot:
        self.calls += 1
        return EngineSnapshot(
            running_by_tenant={"t-busy": 3},
            waiting_by_tenant={"t-busy": 1},
            num_pages_total=256,
            num_pages_free=200,
            counters=EngineStats(
                num_prefill_tokens=1000 * self.calls, num_generated_tokens=100 * self.calls
            ),
        )


def two_points(client: Client) -> dict[str, object]:
    client.get("/admin/v1/metrics/live")
    time.sleep(MIN_INTERVAL_S + 0.05)
    return dict(client.get("/admin/v1/metrics/live").json())


def test_live_points_from_the_engine_and_the_registry(db_url: str) -> None:
    metrics = Metrics()
    app = build_admin_app(db_url, engine=CountingEngine(), metrics=metrics)
    with TestClient(app) as client:
        client.headers["Authorization"] = f"Bearer {ADMIN_TOKEN}"
        tenant = client.post("/admin/v1/tenants", json={"name": "busy"}).json()
        metrics.ttft.observe(9.0)  # before the first reading: never in a point
        first = client.get("/admin/v1/metrics/live").json()
        metrics.ttft.observe(0.3)
        metrics.itl.observe(0.02)
        metrics.requests.labels("chat", "ok").inc(3)
        metrics.requests.labels("chat", "disconnect").inc(2)  # the client's doing: no error
        metrics.requests.labels("chat", "error").inc(1)
        assert first["points"] == []  # a rate needs two readings
        assert first["missing"] == ["refusals"]  # no refusal counter in this registry
        assert first["tenant_names"] == {tenant["id"]: "busy"}
        time.sleep(MIN_INTERVAL_S + 0.05)
        [point] = client.get("/admin/v1/metrics/live").json()["points"]
        seconds = 1000 / point["prompt_tokens_per_s"]
        assert MIN_INTERVAL_S <= seconds < MIN_INTERVAL_S + 2
        assert point["generated_tokens_per_s"] * 10 == pytest.approx(point["prompt_tokens_per_s"])
        assert point["requests_per_s"] * seconds == pytest.approx(6)
        assert point["errors_per_s"] * seconds == pytest.approx(1)
        assert 0.25 < point["ttft_p50_s"] <= 0.5 and 0.01 < point["itl_p99_s"] <= 0.025
        assert point["tenants"] == [
            {"tenant_id": "t-busy", "running": 3, "waiting": 1, "kv_pages": 0}
        ]
        assert point["kv_pages_total"] == 256 and point["refusals_per_min"] is None
        later = client.get("/admin/v1/metrics/live", params={"since": point["at"]}).json()
        assert later["points"] == []  # within a second: the same point, already seen


def test_refusals_appear_once_a_refusal_counter_exists(db_url: str) -> None:
    metrics = Metrics()
    refused = Counter(
        "atrium_refusals", "Refused requests", ["status", "reason"], registry=metrics.registry
    )
    with TestClient(build_admin_app(db_url, metrics=metrics)) as client:
        client.headers["Authorization"] = f"Bearer {ADMIN_TOKEN}"
        client.get("/admin/v1/metrics/live")
        refused.labels("429", "quota").inc(2)
        time.sleep(MIN_INTERVAL_S + 0.05)
        state = client.get("/admin/v1/metrics/live").json()
        assert state["missing"] == ["engine"]  # no engine here: no tokens/s, no tenants
        [point] = state["points"]
        assert set(point["refusals_per_min"]) == {"429 quota"}
        assert 0 < point["refusals_per_min"]["429 quota"] <= 2 * 60 / MIN_INTERVAL_S
        assert point["prompt_tokens_per_s"] is None and point["tenants"] == []


def test_without_metrics_every_series_is_missing(admin: Client) -> None:
    state = two_points(admin)
    assert state["missing"] == ["engine", "ttft", "itl", "refusals", "requests"]
    points = state["points"]
    assert isinstance(points, list) and len(points) == 1
    point = points[0]
    assert point["ttft_p50_s"] is None and point["prompt_tokens_per_s"] is None


def test_bad_since_is_a_400_and_credentials_are_required(admin: Client, anon: Client) -> None:
    for value in ("yesterday", "2026-01-01T00:00:00", "", "9" * 400):
        error = assert_error(admin.get("/admin/v1/metrics/live", params={"since": value}), 400)
        assert "since" in (error["param"] or error["message"])
    assert (
        admin.get(
            "/admin/v1/metrics/live", params={"since": datetime.now(UTC).isoformat()}
        ).status_code
        == 200
    )
    assert_error(anon.get("/admin/v1/metrics/live"), 401, "invalid_admin_token")


def test_the_sampler_keeps_history_from_start_up_without_a_console(db_url: str) -> None:
    """Points are sampled from start-up, not at each poll: a console opened later sees them,
    on a time axis (each point at its own sampling time), and its polls add none."""
    engine = CountingEngine()
    app = build_admin_app(
        db_url, engine=engine, metrics=Metrics(), live_sample_s=MIN_INTERVAL_S + 0.05
    )
    with TestClient(app) as client:
        client.headers["Authorization"] = f"Bearer {ADMIN_TOKEN}"
        deadline = time.monotonic() + 20
        while engine.calls < 3:  # nobody polls the admin API meanwhile
            assert time.monotonic() < deadline, "the sampler did not sample"
            time.sleep(0.05)
        state = client.get("/admin/v1/metrics/live").json()
        assert state["interval_s"] > 0 and state["history_s"] >= 3600
        points = state["points"]
        assert len(points) >= 2
        times = [datetime.fromisoformat(p["at"]) for p in points]
        gaps = [(b - a).total_seconds() for a, b in itertools.pairwise(times)]
        assert all(gap >= MIN_INTERVAL_S for gap in gaps)  # one point a second at most
        calls = engine.calls
        client.get("/admin/v1/metrics/live")
        assert engine.calls <= calls + 1  # a poll reads the history; at most the sampler ran
