"""The console's live charts: points sampled from the gateway's Prometheus registry and the
engines' snapshot, kept for the last hour on the app (``web.admin.live_sampler`` samples from
start-up, whether a console is open or not).

Rates and latency quantiles come from differences of cumulative numbers between two readings,
so a point says what happened lately, not since start. A series the server does not report
(no engine, no latency histograms, no refusal counter) is named in ``missing``.
"""

from __future__ import annotations

import bisect
import itertools
import math
import time
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import msgspec
from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric

from engine.stats import EngineSnapshot
from web.admin.engine_state import TENANT_PREFIX
from web.ops.metrics import ITL, TTFT

MIN_INTERVAL_S = 1.0  # polls closer than this share one point
LATENCY_WINDOW_S = 30.0  # latency quantiles cover at least the last half minute
HISTORY_S = 3600.0  # points older than this are dropped
HISTORY_POINTS = 7200  # and never more than this many (a point a second at most, with room)
REQUESTS_FAMILY = "atrium_requests"
# Finished requests that count as errors: ended by the server, not by the client or a limit.
ERROR_STATUSES = frozenset({"error", "timeout", "unavailable", "rejected", "gateway_lost"})
TTFT_FAMILY = TTFT  # the gateway's histograms (web/ops/metrics.py)
ITL_FAMILY = ITL
REFUSAL_MARK = "refus"  # any counter family named like ``atrium_refusals``
REASON_LABELS = ("status", "reason", "code")  # joined, in this order, as the series' name

Buckets = dict[float, float]  # upper bound -> cumulative count, summed over every label set


class TenantLive(msgspec.Struct, kw_only=True):
    tenant_id: str
    running: int
    waiting: int
    kv_pages: int


class LivePoint(msgspec.Struct, kw_only=True):
    """What the server did between the previous reading and ``at``; None: nothing to measure."""

    at: datetime
    requests_per_s: float | None  # finished requests, errors included
    errors_per_s: float | None  # finished requests that ended in a server-side error
    prompt_tokens_per_s: float | None
    generated_tokens_per_s: float | None
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    itl_p50_s: float | None
    itl_p99_s: float | None
    refusals_per_min: dict[str, float] | None
    kv_pages_total: int | None
    tenants: list[TenantLive]


class LiveMetrics(msgspec.Struct, kw_only=True):
    """``missing``: series this server does not report (``engine``, ``ttft``, ``itl``,
    ``refusals``, ``requests``), drawn as empty charts with a note. ``tenant_names`` names
    every tenant id the points use (a tenant's batch lines, ``<id>/batch``, included)."""

    interval_s: float
    latency_window_s: float
    history_s: float
    missing: list[str]
    tenant_names: dict[str, str]
    points: list[LivePoint]


@dataclass(frozen=True, slots=True)
class Reading:
    """The cumulative numbers at one moment (``None``: not reported)."""

    at: float  # monotonic seconds
    wall: datetime
    requests: dict[str, float] | None  # finished requests by status, since start
    prompt_tokens: int | None
    generated_tokens: int | None
    ttft: Buckets | None
    itl: Buckets | None
    refusals: dict[str, float] | None
    snapshot: EngineSnapshot | None


def quantile(q: float, later: Buckets, earlier: Buckets | None) -> float | None:
    """The ``q`` quantile of the observations between two cumulative bucket readings,
    interpolated inside its bucket (as Prometheus' ``histogram_quantile``)."""
    bounds = sorted(later)
    counts = [later[b] - (earlier or {}).get(b, 0.0) for b in bounds]
    if not counts or counts[-1] <= 0:
        return None
    rank = q * counts[-1]
    lower, below = 0.0, 0.0
    for bound, count in zip(bounds, counts, strict=True):
        if count >= rank:
            if math.isinf(bound):
                return lower  # past the last finite bound: its value is all we know
            inside = count - below
            return lower + (bound - lower) * ((rank - below) / inside if inside else 1.0)
        lower, below = bound, count
    return lower


def _buckets(family: Metric | None) -> Buckets | None:
    if family is None:
        return None
    summed: Buckets = {}
    for sample in family.samples:
        if sample.name.endswith("_bucket"):
            bound = float(sample.labels["le"])
            summed[bound] = summed.get(bound, 0.0) + sample.value
    return summed


def _reason(labels: Mapping[str, str]) -> str:
    """``429 requests_per_minute``: the status and reason labels, else every label but the
    tenant's."""
    named = [labels[name] for name in REASON_LABELS if name in labels]
    rest = [value for name, value in sorted(labels.items()) if name != "tenant"]
    return " ".join(named or rest) or "all"


def _refusals(families: Iterable[Metric]) -> dict[str, float] | None:
    """Refusals by reason, summed over every refusal counter (and tenant); None: none exists."""
    found: dict[str, float] | None = None
    for family in families:
        if family.type != "counter" or REFUSAL_MARK not in family.name:
            continue
        found = {} if found is None else found
        for sample in family.samples:
            if sample.name.endswith("_total"):
                reason = _reason(sample.labels)
                found[reason] = found.get(reason, 0.0) + sample.value
    return found


def _by_status(family: Metric | None) -> dict[str, float] | None:
    """A counter's totals by its ``status`` label, summed over every other label."""
    if family is None:
        return None
    found: dict[str, float] = {}
    for sample in family.samples:
        if sample.name.endswith("_total"):
            status = sample.labels.get("status", "")
            found[status] = found.get(status, 0.0) + sample.value
    return found


def read(registry: CollectorRegistry | None, snapshot: EngineSnapshot | None) -> Reading:
    families = {family.name: family for family in registry.collect()} if registry else {}
    counters = snapshot.counters if snapshot is not None else None
    return Reading(
        at=time.monotonic(),
        wall=datetime.now(UTC),
        requests=_by_status(families.get(REQUESTS_FAMILY)),
        prompt_tokens=None if counters is None else counters.num_prefill_tokens,
        generated_tokens=None if counters is None else counters.num_generated_tokens,
        ttft=_buckets(families.get(TTFT_FAMILY)),
        itl=_buckets(families.get(ITL_FAMILY)),
        refusals=_refusals(families.values()),
        snapshot=snapshot,
    )


def _rate(later: float | None, earlier: float | None, seconds: float) -> float | None:
    if later is None or earlier is None or later < earlier:
        return None  # not reported, or the counter restarted (an engine came back)
    return (later - earlier) / seconds


def _sum(counts: dict[str, float] | None, statuses: frozenset[str] | None = None) -> float | None:
    if counts is None:
        return None
    return sum(v for status, v in counts.items() if statuses is None or status in statuses)


def _tenants(snapshot: EngineSnapshot | None) -> list[TenantLive]:
    if snapshot is None:
        return []
    pages = {
        namespace.removeprefix(TENANT_PREFIX): numbers.resident_pages
        for namespace, numbers in snapshot.cache_by_namespace.items()
        if namespace.startswith(TENANT_PREFIX)
    }
    ids = set(snapshot.running_by_tenant) | set(snapshot.waiting_by_tenant) | set(pages)
    return [
        TenantLive(
            tenant_id=tenant_id,
            running=snapshot.running_by_tenant.get(tenant_id, 0),
            waiting=snapshot.waiting_by_tenant.get(tenant_id, 0),
            kv_pages=pages.get(tenant_id, 0),
        )
        for tenant_id in sorted(ids)
    ]


def point(now: Reading, before: Reading, window_start: Reading) -> LivePoint:
    """The point at ``now``: rates since ``before``, latency since ``window_start``."""
    seconds = max(now.at - before.at, 1e-9)
    refusals = None
    if now.refusals is not None:
        earlier = before.refusals or {}
        refusals = {
            reason: max(count - earlier.get(reason, 0.0), 0.0) * 60.0 / seconds
            for reason, count in sorted(now.refusals.items())
        }

    def latency(q: float, later: Buckets | None, start: Buckets | None) -> float | None:
        return None if later is None else quantile(q, later, start)

    return LivePoint(
        at=now.wall,
        requests_per_s=_rate(_sum(now.requests), _sum(before.requests), seconds),
        errors_per_s=_rate(
            _sum(now.requests, ERROR_STATUSES), _sum(before.requests, ERROR_STATUSES), seconds
        ),
        prompt_tokens_per_s=_rate(now.prompt_tokens, before.prompt_tokens, seconds),
        generated_tokens_per_s=_rate(now.generated_tokens, before.generated_tokens, seconds),
        ttft_p50_s=latency(0.5, now.ttft, window_start.ttft),
        ttft_p99_s=latency(0.99, now.ttft, window_start.ttft),
        itl_p50_s=latency(0.5, now.itl, window_start.itl),
        itl_p99_s=latency(0.99, now.itl, window_start.itl),
        refusals_per_min=refusals,
        kv_pages_total=None if now.snapshot is None else now.snapshot.num_pages_total,
        tenants=_tenants(now.snapshot),
    )


def missing(reading: Reading) -> list[str]:
    gone = {
        "engine": reading.snapshot is None,
        "ttft": reading.ttft is None,
        "itl": reading.itl is None,
        "refusals": reading.refusals is None,
        "requests": reading.requests is None,
    }
    return [name for name, absent in gone.items() if absent]


@dataclass(slots=True)
class LiveHistory:
    """Readings and the points drawn from them, newest last: the last ``HISTORY_S`` seconds,
    one point per ``MIN_INTERVAL_S`` at most, however many consoles poll. ``sampled`` is set
    while a sampler adds readings on its own (then polls only read)."""

    readings: deque[Reading] = field(default_factory=deque)
    points: deque[LivePoint] = field(default_factory=lambda: deque(maxlen=HISTORY_POINTS))
    sampled: bool = False

    @property
    def latest(self) -> Reading | None:
        return self.readings[-1] if self.readings else None

    def add(self, reading: Reading) -> Reading:
        """Record ``reading`` (and its point, from the previous one); returns the latest."""
        if self.readings and reading.at - self.readings[-1].at < MIN_INTERVAL_S:
            return self.readings[-1]
        if self.readings:
            window_start = next(
                (r for r in reversed(self.readings) if reading.at - r.at >= LATENCY_WINDOW_S),
                self.readings[0],
            )
            self.points.append(point(reading, self.readings[-1], window_start))
        self.readings.append(reading)
        # Keep one reading at least a latency window old (the next window's start), no older.
        while len(self.readings) > 2 and reading.at - self.readings[1].at >= LATENCY_WINDOW_S:
            self.readings.popleft()
        oldest = reading.wall - timedelta(seconds=HISTORY_S)
        while self.points and self.points[0].at < oldest:
            self.points.popleft()
        return reading

    def since(self, after: datetime | None) -> list[LivePoint]:
        if after is None:
            return list(self.points)
        # Points are in time order: skip to the first later one.
        index = bisect.bisect_right(self.points, after, key=lambda p: p.at)
        return list(itertools.islice(self.points, index, None))
