"""PublicPrefixSync on the tiny model: lists in, pinned prefixes out, released when gone."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model.loader import LoadedModel, load_model
from engine.outputs import GenerateRequest
from engine.public_prefix_sync import PrefixEntry, PublicPrefixSync
from engine.sampling_params import SamplingParams
from radix_cache.radix_prefix_cache import RadixPrefixCache
from tests.support.async_engine import wait_for

NUM_PAGES = 48


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir: Path) -> LoadedModel:
    return load_model(str(tiny_llama_dir), dtype=torch.float32)


async def cached_tokens(engine: AsyncEngine, prompt: list[int], tenant: str) -> int:
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    request = GenerateRequest(f"{tenant}-{len(prompt)}", prompt, params, tenant)
    outputs = [o async for o in engine.generate(request)]
    return outputs[-1].num_cached_tokens


def test_lists_publish_new_prefixes_and_release_removed_ones(tiny: LoadedModel) -> None:
    async def main() -> None:
        config = EngineConfig(num_pages=NUM_PAGES, max_num_batched_tokens=64, max_num_seqs=4)
        engine = AsyncEngine(LLMEngine(tiny, config, prefix_cache_factory=RadixPrefixCache))
        engine.start()
        sync = PublicPrefixSync(engine)
        rules, style = "shared system rules " * 10, "house style guide " * 10
        try:
            await sync.apply([PrefixEntry("pp_a", rules), PrefixEntry("pp_b", style)], "v1")
            held_a, held_b = sync.held("pp_a"), sync.held("pp_b")
            assert held_a is not None and held_b is not None and sync.version == "v1"
            assert held_a.num_cached_tokens == held_a.num_tokens // 16 * 16 > 0
            pinned = (held_a.num_cached_tokens + held_b.num_cached_tokens) // 16
            # The snapshot is taken once the engine is idle again.
            await wait_for(lambda: engine.stats().num_pages_available == NUM_PAGES - pinned)
            ids = tiny.tokenizer.encode(rules)
            assert await cached_tokens(engine, [*ids, 5, 6], "acme") == held_a.num_cached_tokens

            # The same text under a second id shares the pin; dropping one id keeps it.
            await sync.apply([PrefixEntry("pp_b", style), PrefixEntry("pp_c", rules)], "v2")
            assert sync.held("pp_a") is None and sync.held_ids == ["pp_b", "pp_c"]
            assert await cached_tokens(engine, [*ids, 7, 8], "globex") > 0

            await sync.apply([PrefixEntry("pp_b", style)], "v3")
            assert await cached_tokens(engine, [*ids, 9, 10], "initech") == 0
            left = NUM_PAGES - held_b.num_cached_tokens // 16
            await wait_for(lambda: engine.stats().num_pages_available == left)

            # A prefix the engine refuses is recorded with its error; the others still apply.
            too_long = "word " * 2000
            await sync.apply([PrefixEntry("pp_b", style), PrefixEntry("pp_x", too_long)], "v4")
            refused = sync.held("pp_x")
            assert refused is not None and refused.error and refused.num_cached_tokens == 0
            await sync.apply([], "v5")
            assert sync.held_ids == []
            await wait_for(lambda: engine.stats().num_pages_available == NUM_PAGES)
        finally:
            await engine.shutdown()

    asyncio.run(main())
