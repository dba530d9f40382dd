"""After many finished, aborted and preempted requests on a tiny KV pool, every page is back,
with steps read at once and with overlapped decode steps (engine/overlap.py, forced on)."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model.loader import load_model
from engine.outputs import GenerateRequest
from engine.sampling_params import SamplingParams
from radix_cache.page_pool import PagePool
from radix_cache.prefix_cache import PrefixCache
from radix_cache.radix_prefix_cache import RadixPrefixCache

NUM_REQUESTS = 500  # per cache kind and step mode: 2,000 in all


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("factory", [None, RadixPrefixCache], ids=["no_cache", "radix"])
def test_mixed_requests_leave_no_page_behind(
    tiny_llama_dir: Path, factory: Callable[[PagePool, int], PrefixCache] | None, overlap: bool
) -> None:
    loaded = load_model(str(tiny_llama_dir), dtype=torch.float32)
    config = EngineConfig(page_size=4, num_pages=24, max_num_batched_tokens=48, max_num_seqs=16)
    engine = LLMEngine(loaded, config, prefix_cache_factory=factory, overlap=overlap)
    rng = random.Random(0)
    shared = [rng.randrange(256) for _ in range(12)]
    finished: dict[str, str] = {}
    live: list[str] = []
    submitted = 0
    steps = 0
    while submitted < NUM_REQUESTS or engine.has_unfinished:
        for _ in range(rng.randint(0, 12)):
            if submitted == NUM_REQUESTS:
                break
            tail = [rng.randrange(256) for _ in range(rng.randint(1, 40))]
            prompt = ([*shared, *tail] if rng.random() < 0.5 else tail)[:90]
            params = SamplingParams(
                max_tokens=rng.randint(1, 8), temperature=rng.choice([0.0, 1.0]), ignore_eos=True
            )
            rid = f"r{submitted}"
            engine.add_request(GenerateRequest(rid, prompt, params, tenant_id=rng.choice("ab")))
            live.append(rid)
            submitted += 1
        if live and rng.random() < 0.2:
            engine.abort(live[rng.randrange(len(live))])
        for output in engine.step():
            if output.finished:
                assert output.request_id not in finished, "finished twice"
                finished[output.request_id] = output.finish_reason or ""
                live.remove(output.request_id)
        steps += 1
        assert steps < 20_000
    assert len(finished) == NUM_REQUESTS
    reasons = set(finished.values())
    assert {"length", "abort"} <= reasons
    assert engine.stats.num_preemptions > 0, "the pool was meant to force preemption"
    assert (engine.stats.num_overlapped_steps > 0) == overlap
    pool = engine.cache.pool
    pool.check_integrity()
    engine.cache.check_integrity()
    assert all(not pool.owner(page).startswith("req:") for page in range(pool.num_pages))
    assert engine.cache.num_available_pages == pool.num_pages
    if factory is None:
        assert pool.num_free_pages == pool.num_pages
