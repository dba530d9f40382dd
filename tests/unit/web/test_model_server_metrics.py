"""The model-server gauges an engine's /metrics shows from its snapshot: vLLM's LoRA gauge only
where adapters are on, its adapters comma-separated, its value the snapshot's time."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from engine.stats import EngineSnapshot
from web.engine_api.metrics import LORA_INFO, ModelServerCollector


def _families(snapshot: EngineSnapshot) -> dict[str, list[tuple[dict[str, str], float]]]:
    registry = CollectorRegistry()
    registry.register(ModelServerCollector(lambda: snapshot, "tiny"))
    text = generate_latest(registry).decode()
    return {
        family.name: [(sample.labels, sample.value) for sample in family.samples]
        for family in text_string_to_metric_families(text)
    }


def test_lora_gauge_names_running_and_waiting_adapters() -> None:
    snapshot = EngineSnapshot(
        max_loras=4,
        running_lora_adapters=("la_a", "la_b"),
        waiting_lora_adapters=("la_c",),
        taken_at=1_790_000_000.25,
    )
    (sample,) = _families(snapshot)[LORA_INFO]
    labels, value = sample
    assert labels == {
        "max_lora": "4",
        "running_lora_adapters": "la_a,la_b",
        "waiting_lora_adapters": "la_c",
    }
    assert value == 1_790_000_000.25
    idle = _families(EngineSnapshot(max_loras=4, taken_at=1.0))[LORA_INFO]
    assert idle == [({"max_lora": "4", "running_lora_adapters": "", "waiting_lora_adapters": ""},
                     1.0)]  # fmt: skip


def test_no_lora_gauge_without_adapters() -> None:
    families = _families(EngineSnapshot(taken_at=1.0))
    assert LORA_INFO not in families
    assert "vllm:num_requests_running" in families
