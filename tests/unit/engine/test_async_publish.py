"""Publishing a public prefix through the AsyncEngine: text or ids in, shared pages out."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model.loader import LoadedModel, load_model
from engine.outputs import GenerateRequest, RequestOutput
from engine.sampling_params import SamplingParams
from radix_cache.radix_prefix_cache import RadixPrefixCache


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir: Path) -> LoadedModel:
    return load_model(str(tiny_llama_dir), dtype=torch.float32)


def start(tiny: LoadedModel, caching: bool) -> AsyncEngine:
    config = EngineConfig(num_pages=48, max_num_batched_tokens=64, max_num_seqs=4)
    factory = RadixPrefixCache if caching else None
    engine = AsyncEngine(LLMEngine(tiny, config, prefix_cache_factory=factory))
    engine.start()
    return engine


async def last_output(engine: AsyncEngine, prompt: list[int], tenant: str) -> RequestOutput:
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    outputs = [o async for o in engine.generate(GenerateRequest(tenant, prompt, params, tenant))]
    return outputs[-1]


def test_published_text_is_shared_with_every_tenant(tiny: LoadedModel) -> None:
    async def main() -> None:
        engine = start(tiny, caching=True)
        try:
            text = "shared system rules " * 12
            ids = tiny.tokenizer.encode(text)
            published = await engine.publish_prefix(text)
            assert published.num_tokens == len(ids)
            assert published.num_cached_tokens == len(ids) // 16 * 16 > 0
            for tenant in ("acme", "globex"):
                out = await last_output(engine, [*ids, 5, 6, 7], tenant)
                assert out.num_cached_tokens == published.num_cached_tokens
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_publishing_without_prefix_caching_keeps_nothing(tiny: LoadedModel) -> None:
    async def main() -> None:
        engine = start(tiny, caching=False)
        try:
            published = await engine.publish_prefix(list(range(1, 40)))
            assert published == type(published)(num_tokens=39, num_cached_tokens=0)
            assert engine.stats().num_pages_free == 48
        finally:
            await engine.shutdown()

    asyncio.run(main())
