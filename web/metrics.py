"""Prometheus metrics of one app, in a registry of its own (never the process-global default)."""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class GatewayMetrics:
    """Requests, tokens per tenant, latency histograms and the engine's live gauges."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "atrium_requests", "Finished API requests", ["tenant", "endpoint", "status"], registry=r
        )
        self.prompt_tokens = Counter(
            "atrium_prompt_tokens", "Prompt tokens served", ["tenant"], registry=r
        )
        self.cached_tokens = Counter(
            "atrium_cached_prompt_tokens", "Prompt tokens served from the prefix cache", ["tenant"],
            registry=r,
        )  # fmt: skip
        self.completion_tokens = Counter(
            "atrium_completion_tokens", "Completion tokens generated", ["tenant"], registry=r
        )
        self.prefix_hit_rate = Gauge(
            "atrium_prefix_cache_hit_rate", "Cached / prompt tokens so far", ["tenant"], registry=r
        )
        self.ttft = Histogram(
            "atrium_time_to_first_token_seconds", "Time to first token", ["tenant"],
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

    def observe_usage(self, tenant: str, prompt: int, cached: int, completion: int) -> None:
        self.prompt_tokens.labels(tenant).inc(prompt)
        self.cached_tokens.labels(tenant).inc(cached)
        self.completion_tokens.labels(tenant).inc(completion)
        total_prompt, total_cached = self._seen.get(tenant, (0, 0))
        total_prompt, total_cached = total_prompt + prompt, total_cached + cached
        self._seen[tenant] = (total_prompt, total_cached)
        if total_prompt:
            self.prefix_hit_rate.labels(tenant).set(total_cached / total_prompt)

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
