"""The engines this process runs: each served model loaded and its engine started (in a child
process by default), several engines seen as one, and the gauges /metrics reads from them."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import msgspec

from engine.config import EngineConfig
from engine.factory import EngineSpec
from engine.kv_budget import default_memory_fraction
from engine.launch import start_engine
from engine.load_progress import progress_for
from engine.stats import EngineSnapshot
from web.engine_api.fleet import merge_snapshots
from web.openai.generation import ModelRuntime
from web.ops.logging import configure_logging
from web.settings import Settings

Closer = Callable[[], Awaitable[None]]


async def load_runtime(settings: Settings) -> tuple[ModelRuntime, Any, Closer]:
    """Load the model named by ``settings`` (off the event loop) and start an engine on it.

    By default the engine runs in a child process (its kernels then never wait for this
    process's GIL); ``engine_process=False`` keeps it on a thread of the gateway.
    """
    settings = settings.single_model()
    config = EngineConfig(
        kv_cache_bytes=settings.kv_cache_bytes,
        kv_cache_memory_fraction=settings.kv_cache_memory_fraction,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        max_num_seqs=settings.max_num_seqs,
        max_model_len=settings.max_model_len,
        speculative_tokens=settings.speculative_tokens,
        speculative_max_batch=settings.speculative_max_batch,
        target_tpot_ms=settings.engine_target_tpot_ms,
        target_ttft_ms=settings.engine_target_ttft_ms,
        max_loras=settings.max_loras,
        max_lora_rank=settings.max_lora_rank,
        prefill_kernel=settings.prefill_kernel,
        cuda_graphs=settings.engine_cuda_graphs,
        cuda_graph_sizes=settings.engine_cuda_graph_sizes,
        overlap_steps=settings.engine_overlap_steps,
        dtype=settings.resolved_dtype,
        device=settings.resolved_device,
    )
    spec = EngineSpec(
        model=settings.model,
        dtype=config.dtype,
        config=config,
        torch_threads=settings.torch_threads,
        setup=functools.partial(configure_logging, settings.log_level),
    )
    in_process = not settings.engine_process
    # A child process reports its own start-up; on a thread of this process, this one does.
    progress = progress_for() if in_process else None
    try:
        running = await asyncio.to_thread(
            start_engine, spec, in_process=in_process, progress=progress
        )
    finally:
        if progress is not None:
            progress.close()
    engine: Any = running.client
    tokenizer, name, max_model_len = running.tokenizer, running.name, running.max_model_len
    snapshot = engine.stats()
    capacity = int(snapshot.num_pages_total) * int(snapshot.page_size)
    runtime = ModelRuntime(
        name=settings.served_model_name or name,
        engine=engine,
        tokenizer=tokenizer,
        max_model_len=max_model_len,
        aliases=("default",) if settings.model == "default" else (),
        stats=lambda: engine_numbers(engine.stats()),
        kv_capacity_tokens=capacity or None,
    )
    return runtime, engine, engine.shutdown


class EngineGroup:
    """The engines of several served models, as the one ``app.state.engine`` others call:
    a tenant's pages are dropped in every engine, and all of them must be running."""

    def __init__(self, engines: Sequence[Any]) -> None:
        self.engines = list(engines)

    @property
    def is_running(self) -> bool:
        return all(getattr(engine, "is_running", True) for engine in self.engines)

    def drop_tenant(self, tenant_id: str) -> None:
        for engine in self.engines:
            drop = getattr(engine, "drop_tenant", None)
            if callable(drop):
                drop(tenant_id)

    def stats(self) -> Any:
        """The engines' snapshots summed (pages, queues, counters, per-tenant numbers)."""
        snapshots = [engine.stats() for engine in self.engines]
        if all(isinstance(snapshot, EngineSnapshot) for snapshot in snapshots):
            return merge_snapshots(snapshots)
        return snapshots[0]


async def load_runtimes(settings: Settings) -> tuple[list[ModelRuntime], Any, Closer]:
    """Every model ``settings.model`` names, each in its own engine with its own KV pool.

    One after another, so that each engine sizes its pool from what the earlier ones left:
    with N models each takes ``kv_cache_memory_fraction / N`` of the memory free when it
    starts (or ``kv_cache_bytes`` each), so together they stay within the one fraction.
    """
    specs = settings.model_specs
    if len(specs) == 1:
        runtime, engine, close = await load_runtime(settings)
        return [runtime], engine, close

    fraction = settings.kv_cache_memory_fraction
    if fraction is None:
        fraction = default_memory_fraction(settings.resolved_device.split(":")[0])
    runtimes: list[ModelRuntime] = []
    engines: list[Any] = []
    closers: list[Closer] = []

    async def close_all() -> None:
        for close in reversed(closers):
            await close()

    try:
        for name, path in specs:
            one = msgspec.structs.replace(
                settings,
                model=path,
                served_model_name=name,
                kv_cache_memory_fraction=fraction / len(specs),
            )
            runtime, engine, close = await load_runtime(one)
            runtimes.append(runtime)
            engines.append(engine)
            closers.append(close)
    except BaseException:
        await close_all()
        raise
    names = [runtime.name for runtime in runtimes]
    if len(set(names)) != len(names):
        await close_all()
        raise ValueError(f"two served models have the same name: {names}")
    return runtimes, EngineGroup(engines), close_all


def engine_numbers(snapshot: Any) -> dict[str, object]:
    """The gauges /metrics shows, from the engine's snapshot."""
    total = int(getattr(snapshot, "num_pages_total", 0))
    free = int(getattr(snapshot, "num_pages_free", 0))
    available = int(getattr(snapshot, "num_pages_available", free))
    counters = getattr(snapshot, "counters", None)
    kv_pages: dict[str, int] = {}
    for namespace, numbers in getattr(snapshot, "cache_by_namespace", {}).items():
        if namespace.startswith("tenant:"):  # a tenant's own, or its adapters' ("…/lora:…")
            tenant = namespace.removeprefix("tenant:").split("/", 1)[0]
            kv_pages[tenant] = kv_pages.get(tenant, 0) + int(numbers.resident_pages)
    return {
        "num_waiting": getattr(snapshot, "num_waiting", 0),
        "num_running": getattr(snapshot, "num_running", 0),
        "num_pages_total": total,
        "num_pages_used": total - free,
        "num_pages_cached": available - free,
        "num_preemptions": getattr(counters, "num_preemptions", None),
        "num_draft_tokens": getattr(counters, "num_draft_tokens", None),
        "num_accepted_draft_tokens": getattr(counters, "num_accepted_draft_tokens", None),
        "waiting_by_tenant": dict(getattr(snapshot, "waiting_by_tenant", {})),
        "running_by_tenant": dict(getattr(snapshot, "running_by_tenant", {})),
        "queue_wait_by_tenant": dict(getattr(snapshot, "queue_wait_by_tenant", {})),
        "kv_pages_by_tenant": kv_pages,
    }
