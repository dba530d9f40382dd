"""A suspended or deleted tenant's cached prefix pages are freed at once, other tenants' stay.

Through both engine clients: the step loop on a thread, and in a child process.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from engine.async_engine import AsyncEngine, EngineClient
from engine.config import EngineConfig
from engine.factory import EngineSpec
from engine.llm_engine import LLMEngine
from engine.model.loader import load_model, load_tokenizer
from engine.outputs import GenerateRequest
from engine.process_engine import ProcessEngine
from engine.sampling_params import SamplingParams
from radix_cache.prefix_cache import tenant_namespace
from radix_cache.radix_prefix_cache import RadixPrefixCache
from tests.support.async_engine import collect, wait_for

CONFIG = EngineConfig(
    page_size=4, num_pages=64, max_num_batched_tokens=64, max_num_seqs=4, dtype="float32"
)


def _resident(engine: EngineClient, tenant: str) -> int:
    snapshot = engine.stats().cache_by_namespace.get(tenant_namespace(tenant))
    return 0 if snapshot is None else snapshot.resident_pages


async def _scenario(engine: EngineClient) -> None:
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    for tenant, first in (("a", 1), ("b", 100)):
        prompt = list(range(first, first + 21))  # five full pages of prompt
        await collect(engine, GenerateRequest(f"{tenant}-1", prompt, params, tenant_id=tenant))
    await wait_for(lambda: _resident(engine, "a") >= 5 and _resident(engine, "b") >= 5)
    kept = _resident(engine, "b")
    engine.drop_tenant("a")
    engine.drop_tenant("nobody")  # unknown: nothing happens
    await wait_for(lambda: _resident(engine, "a") == 0)
    assert _resident(engine, "b") == kept
    # The engine serves on; tenant a starts from an empty cache.
    prompt = list(range(1, 22))
    outputs = await collect(engine, GenerateRequest("a-2", prompt, params, tenant_id="a"))
    assert outputs[-1].finished and outputs[-1].num_cached_tokens == 0


def test_the_thread_engine_drops_a_tenants_cached_pages(tiny_llama_dir: Path) -> None:
    loaded = load_model(str(tiny_llama_dir), dtype=torch.float32)
    engine = AsyncEngine(LLMEngine(loaded, CONFIG, prefix_cache_factory=RadixPrefixCache))

    async def body() -> None:
        engine.start()
        try:
            await _scenario(engine)
        finally:
            await engine.shutdown()

    asyncio.run(body())


@pytest.mark.slow
def test_the_process_engine_drops_a_tenants_cached_pages(tiny_llama_dir: Path) -> None:
    spec = EngineSpec(model=str(tiny_llama_dir), dtype="float32", config=CONFIG, torch_threads=1)
    engine = ProcessEngine(spec, load_tokenizer(str(tiny_llama_dir))[0])

    async def body() -> None:
        engine.start()
        try:
            await _scenario(engine)
        finally:
            await engine.shutdown()

    asyncio.run(body())
