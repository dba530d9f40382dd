"""Prometheus metrics of one app, in a registry of its own (never the process-global default).

Tenant ids appear as a ``tenant`` label only when asked for (``metrics_tenant_labels``): by
default the request and token metrics are totals, so /metrics names no tenant. The request
latency histograms take vLLM's names and its ``model_name`` label, so dashboards built for vLLM
read them as they are.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeGuard, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics import MetricWrapperBase

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# Whole requests run longer than their first token: up to the longest stream a server allows.
REQUEST_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
# The exposition format's media type; the response appends its charset itself (once).
MEDIA_TYPE, _, _ = CONTENT_TYPE_LATEST.partition("; charset=")
E2E_LATENCY = "vllm:e2e_request_latency_seconds"
QUEUE_TIME = "vllm:request_queue_time_seconds"
TTFT = "vllm:time_to_first_token_seconds"
ITL = "vllm:inter_token_latency_seconds"
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
        by_model = tenant_labels(t, "model_name")
        self.e2e = Histogram(
            E2E_LATENCY, "Request latency, from its arrival to its last token", by_model,
            buckets=REQUEST_BUCKETS, registry=r,
        )  # fmt: skip
        self.queue_time = Histogram(
            QUEUE_TIME, "Time waiting to be admitted: the fair gate, then quotas and budget",
            by_model, buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.ttft = Histogram(
            TTFT, "Time to first token, from the request's arrival", by_model,
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.itl = Histogram(
            ITL, "Time between output tokens", by_model, buckets=LATENCY_BUCKETS, registry=r
        )
        self.in_flight = Gauge("atrium_requests_in_flight", "Requests being served", registry=r)
        self.queue_depth = Gauge("atrium_engine_queue_depth", "Requests waiting", registry=r)
        self.running = Gauge("atrium_engine_running_requests", "Requests running", registry=r)
        self.kv_pages_used = Gauge("atrium_kv_pages_used", "KV pages in use", registry=r)
        self.kv_pages_cached = Gauge("atrium_kv_pages_cached", "KV pages in the cache", registry=r)
        self.kv_pages_total = Gauge("atrium_kv_pages_total", "KV pages in the pool", registry=r)
        self.refusals = Counter(
            "atrium_refusals", "Requests refused: 401, 403, 429 (by quota) and 503 (by cause)",
            ["status", "reason"], registry=r,
        )  # fmt: skip
        self.engine_counters = {
            "num_preemptions": Counter(
                "atrium_engine_preemptions", "Running requests preempted (KV pages taken back)",
                registry=r,
            ),
            "num_draft_tokens": Counter(
                "atrium_draft_tokens", "Speculative draft tokens checked", registry=r
            ),
            "num_accepted_draft_tokens": Counter(
                "atrium_draft_tokens_accepted", "Draft tokens the model agreed with", registry=r
            ),
        }  # fmt: skip
        self._engine_seen: dict[str, float] = {}
        # Per-tenant engine gauges exist only with tenant labels on (they name tenants).
        self.tenant_gauges: dict[str, Gauge] = {}
        if per_tenant:
            self.tenant_gauges = {
                "waiting_by_tenant": Gauge(
                    "atrium_tenant_queue_depth", "Requests of the tenant waiting", ["tenant"],
                    registry=r,
                ),
                "running_by_tenant": Gauge(
                    "atrium_tenant_running_requests", "Requests of the tenant running",
                    ["tenant"], registry=r,
                ),
                "queue_wait_by_tenant": Gauge(
                    "atrium_tenant_queue_wait_seconds",
                    "Seconds the tenant's longest-waiting request has waited", ["tenant"],
                    registry=r,
                ),
                "kv_pages_by_tenant": Gauge(
                    "atrium_tenant_kv_pages", "KV pages the tenant's prefixes hold in the cache",
                    ["tenant"], registry=r,
                ),
            }  # fmt: skip
        self._seen: dict[str, tuple[int, int]] = {}

    def count_request(self, tenant: str, endpoint: str, status: str) -> None:
        child(self.requests, self.per_tenant, tenant, endpoint, status).inc()

    def count_refusal(self, status: int, reason: str) -> None:
        self.refusals.labels(str(status), reason).inc()

    def observe_ttft(self, tenant: str, model: str, seconds: float) -> None:
        child(self.ttft, self.per_tenant, tenant, model).observe(seconds)

    def observe_itl(self, tenant: str, model: str, seconds: float) -> None:
        child(self.itl, self.per_tenant, tenant, model).observe(seconds)

    def observe_e2e(self, tenant: str, model: str, seconds: float) -> None:
        child(self.e2e, self.per_tenant, tenant, model).observe(seconds)

    def observe_queue(self, tenant: str, model: str, seconds: float) -> None:
        child(self.queue_time, self.per_tenant, tenant, model).observe(seconds)

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
            if _is_number(value):
                gauge.set(value)
        for name, counter in self.engine_counters.items():
            value = stats.get(name)
            if _is_number(value):
                # The engine's totals; one that went down is a restarted engine counting anew.
                last = self._engine_seen.get(name, 0.0)
                counter.inc(value - last if value >= last else value)
                self._engine_seen[name] = float(value)
        for name, per_tenant in self.tenant_gauges.items():
            values = stats.get(name)
            if not isinstance(values, Mapping):
                continue
            for tenant in {labels["tenant"] for labels in _label_sets(per_tenant)} - set(values):
                per_tenant.remove(tenant)  # a tenant with nothing left is no longer shown
            for tenant, value in values.items():
                if _is_number(value):
                    per_tenant.labels(str(tenant)).set(value)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _is_number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _label_sets(gauge: Gauge) -> list[dict[str, str]]:
    return [sample.labels for metric in gauge.collect() for sample in metric.samples]
