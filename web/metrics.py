"""Prometheus metrics of one app, in a registry of its own (never the process-global default).

Tenant ids appear as a ``tenant`` label only when asked for (``metrics_tenant_labels``): by
default the request and token metrics are totals, so /metrics names no tenant.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics import MetricWrapperBase

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
CONTENT_TYPE = CONTENT_TYPE_LATEST
M = TypeVar("M", bound=MetricWrapperBase)


def tenant_labels(enabled: bool, *others: str) -> list[str]:
    """Label names of a metric that is per tenant when ``enabled``."""
    return ["tenant", *others] if enabled else list(others)


def child(metric: M, enabled: bool, tenant: str, *others: str) -> M:
    """The series of ``metric`` for ``tenant`` (or the total, when tenant labels are off)."""
    values = (tenant, *others) if enabled else others
    return metric.labels(*values) if values else metric


class GatewayMetrics:
    """Requests, tokens (per tenant if asked), latency histograms and the engine's live gauges."""

    def __init__(self, *, per_tenant: bool = False) -> None:
        self.per_tenant = per_tenant
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        t = per_tenant
        self.requests = Counter(
            "atrium_requests", "Finished API requests", tenant_labels(t, "endpoint", "status"),
            registry=r,
        )  # fmt: skip
        self.prompt_tokens = Counter(
            "atrium_prompt_tokens", "Prompt tokens served", tenant_labels(t), registry=r
        )
        self.cached_tokens = Counter(
            "atrium_cached_prompt_tokens", "Prompt tokens served from the prefix cache",
            tenant_labels(t), registry=r,
        )  # fmt: skip
        self.completion_tokens = Counter(
            "atrium_completion_tokens", "Completion tokens generated", tenant_labels(t), registry=r
        )
        self.prefix_hit_rate = Gauge(
            "atrium_prefix_cache_hit_rate", "Cached / prompt tokens so far", tenant_labels(t),
            registry=r,
        )  # fmt: skip
        self.ttft = Histogram(
            "atrium_time_to_first_token_seconds", "Time to first token", tenant_labels(t),
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.itl = Histogram(
            "atrium_inter_token_latency_seconds", "Time between output tokens",
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.in_flight = Gauge("atrium_requests_in_flight", "Requests being served", registry=r)
        self.queue_depth = Gauge("atrium_engine_queue_depth", "Requests waiting", registry=r)
        self.running = Gauge("atrium_engine_running_requests", "Requests running", registry=r)
        self.kv_pages_used = Gauge("atrium_kv_pages_used", "KV pages in use", registry=r)
        self.kv_pages_cached = Gauge("atrium_kv_pages_cached", "KV pages in the cache", registry=r)
        self.kv_pages_total = Gauge("atrium_kv_pages_total", "KV pages in the pool", registry=r)
        self._seen: dict[str, tuple[int, int]] = {}

    def count_request(self, tenant: str, endpoint: str, status: str) -> None:
        child(self.requests, self.per_tenant, tenant, endpoint, status).inc()

    def observe_ttft(self, tenant: str, seconds: float) -> None:
        child(self.ttft, self.per_tenant, tenant).observe(seconds)

    def observe_usage(self, tenant: str, prompt: int, cached: int, completion: int) -> None:
        t = self.per_tenant
        child(self.prompt_tokens, t, tenant).inc(prompt)
        child(self.cached_tokens, t, tenant).inc(cached)
        child(self.completion_tokens, t, tenant).inc(completion)
        key = tenant if t else ""
        total_prompt, total_cached = self._seen.get(key, (0, 0))
        total_prompt, total_cached = total_prompt + prompt, total_cached + cached
        self._seen[key] = (total_prompt, total_cached)
        if total_prompt:
            child(self.prefix_hit_rate, t, tenant).set(total_cached / total_prompt)

    def update_engine(self, stats: Mapping[str, object]) -> None:
        """Copy the engine's numbers that are present (names as the engine reports them)."""
        gauges = {
            "num_waiting": self.queue_depth,
            "num_running": self.running,
            "num_pages_used": self.kv_pages_used,
            "num_pages_cached": self.kv_pages_cached,
            "num_pages_total": self.kv_pages_total,
        }
        for name, gauge in gauges.items():
            value = stats.get(name)
            if isinstance(value, int | float) and not isinstance(value, bool):
                gauge.set(value)

    def render(self) -> bytes:
        return generate_latest(self.registry)
