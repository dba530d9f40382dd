"""The engine's /metrics: the queue per tenant beside the router's gauges."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from engine.stats import EngineSnapshot
from web.engine_api.metrics import TENANT_OLDEST_WAIT, TENANT_WAITING, ModelServerCollector


def test_each_waiting_tenant_has_its_queue_length_and_oldest_wait() -> None:
    snapshot = EngineSnapshot(
        running_by_tenant={"a": 3},
        waiting_by_tenant={"a": 2, "flood": 40},
        oldest_wait_by_tenant={"a": 0.25, "flood": 7.5},
        num_pages_total=10,
        num_pages_available=10,
        page_size=16,
    )
    registry = CollectorRegistry()
    registry.register(ModelServerCollector(lambda: snapshot, "m"))
    text = generate_latest(registry).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    waiting = {s.labels["tenant"]: s.value for s in families[TENANT_WAITING].samples}
    oldest = {s.labels["tenant"]: s.value for s in families[TENANT_OLDEST_WAIT].samples}
    assert waiting == {"a": 2, "flood": 40}
    assert oldest == {"a": 0.25, "flood": 7.5}
    (total,) = families["vllm:num_requests_waiting"].samples
    assert total.value == 42
