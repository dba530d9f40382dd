"""The model-server protocol's gauges, under vLLM's names, read from the engine's snapshot.

Routers (smg, the llm-d endpoint picker) read these to place requests: queue depth, running
requests, KV cache use (0..1; cached pages that can be evicted count as free, as in vLLM) and the
cache's geometry. Prefix-cache queries and hits are counted in tokens, as vLLM counts them. With
LoRA on, ``vllm:lora_requests_info`` names the adapters of the running and of the waiting requests
in its labels (the ids the gateway sends in ``atrium_lora_id``), its value the snapshot's time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from engine.stats import EngineSnapshot

WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
KV_USAGE = "vllm:kv_cache_usage_perc"
CACHE_CONFIG = "vllm:cache_config_info"
PREFIX_QUERIES = "vllm:prefix_cache_queries"
PREFIX_HITS = "vllm:prefix_cache_hits"
LORA_INFO = "vllm:lora_requests_info"
LORA_LABELS = ["max_lora", "running_lora_adapters", "waiting_lora_adapters"]


def kv_cache_usage(snapshot: EngineSnapshot) -> float:
    """Share of KV pages that cannot be had for a new request right now."""
    total = snapshot.num_pages_total
    return (total - snapshot.num_pages_available) / total if total else 0.0


class ModelServerCollector(Collector):
    """Collects the ``vllm:*`` series from the latest snapshot at each scrape."""

    def __init__(self, snapshot: Callable[[], EngineSnapshot], model_name: str) -> None:
        self._snapshot = snapshot
        self._model_name = model_name

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        snap = self._snapshot()
        labels = ["model_name"]
        model = [self._model_name]
        waiting = GaugeMetricFamily(WAITING, "Requests waiting to be scheduled", labels=labels)
        waiting.add_metric(model, snap.num_waiting)
        running = GaugeMetricFamily(RUNNING, "Requests being run", labels=labels)
        running.add_metric(model, snap.num_running)
        usage = GaugeMetricFamily(KV_USAGE, "KV cache usage (1 = full)", labels=labels)
        usage.add_metric(model, kv_cache_usage(snap))
        config = GaugeMetricFamily(
            CACHE_CONFIG, "KV cache geometry", labels=["block_size", "num_gpu_blocks"]
        )
        config.add_metric([str(snap.page_size), str(snap.num_pages_total)], 1.0)
        counters = snap.counters
        queries = CounterMetricFamily(
            PREFIX_QUERIES, "Prompt tokens looked up in the prefix cache", labels=labels
        )
        queries.add_metric(model, counters.num_prefill_tokens + counters.num_cached_tokens)
        hits = CounterMetricFamily(
            PREFIX_HITS, "Prompt tokens served from the prefix cache", labels=labels
        )
        hits.add_metric(model, counters.num_cached_tokens)
        yield from (waiting, running, usage, config, queries, hits)
        if snap.max_loras > 0:
            yield lora_info(snap)


def lora_info(snap: EngineSnapshot) -> GaugeMetricFamily:
    """vLLM's LoRA gauge: the adapters in comma-separated labels, and as its value the time
    they were seen (vLLM sets it to the current time at each update)."""
    info = GaugeMetricFamily(LORA_INFO, "Running stats on lora requests.", labels=LORA_LABELS)
    names = [
        str(snap.max_loras),
        ",".join(snap.running_lora_adapters),
        ",".join(snap.waiting_lora_adapters),
    ]
    info.add_metric(names, snap.taken_at)
    return info
