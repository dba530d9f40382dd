"""The in-process driver on a tiny random Llama: hit rates against the ideal, cache call timing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench.cache_timer import CacheTimer
from bench.engine_driver import ListSource, drive
from bench.engine_runs import run_decode, run_prefill
from bench.workloads import SharedPrefixShape, shared_prefix_prompts
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model.loader import LoadedModel, load_model
from radix_cache import RadixPrefixCache


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir: Path) -> LoadedModel:
    return load_model(str(tiny_llama_dir), dtype=torch.float32)


def _engine(tiny: LoadedModel, cache_on: bool) -> LLMEngine:
    config = EngineConfig(
        page_size=4, num_pages=256, max_num_batched_tokens=64, enable_prefix_cache=cache_on
    )
    return LLMEngine(tiny, config, prefix_cache_factory=RadixPrefixCache)


SHAPE = SharedPrefixShape(2, 2, 3, system_len=16, question_len=6, output_len=3)


def test_one_at_a_time_the_radix_cache_reaches_the_ideal_hit_rate(tiny: LoadedModel) -> None:
    engine = _engine(tiny, cache_on=True)
    timer = CacheTimer()
    timer.install(engine.cache)
    prompts = shared_prefix_prompts(SHAPE, seed=3, high=250)
    run = drive(engine, ListSource(prompts), 1, 4, "x")
    assert len(run.records) == 12
    assert all(r.ok and r.completion_tokens == 3 and len(r.token_times) == 3 for r in run.records)
    cached = sum(r.cached_tokens for r in run.records)
    # 8 of 12 prompts reuse their 16-token system prompt (4 pages of 4).
    assert run.ideal_cached_tokens == 8 * 16
    assert cached == run.ideal_cached_tokens
    assert timer.num_match >= 12  # admission, and the policy's locality ordering
    assert timer.num_insert >= 12
    assert timer.match_s > 0 and timer.insert_s > 0


def test_with_the_cache_off_nothing_is_reused(tiny: LoadedModel) -> None:
    engine = _engine(tiny, cache_on=False)
    prompts = shared_prefix_prompts(SHAPE, seed=3, high=250)
    run = drive(engine, ListSource(prompts), 4, 4, "y")
    assert len(run.records) == 12
    assert sum(r.cached_tokens for r in run.records) == 0
    assert run.ideal_cached_tokens > 0


def test_prefill_and_decode_phases_count_their_tokens(tiny: LoadedModel) -> None:
    engine = _engine(tiny, cache_on=False)
    prompts = [[10 + i] * 20 for i in range(3)]
    prefill = run_prefill(engine, prompts, "p")
    assert prefill.tokens == 60 and prefill.num_steps >= 1
    decode = run_decode(engine, prompts, 5, "d")
    assert decode.tokens == 15
    assert decode.num_steps == 5
    assert decode.split["forward_s"] > 0
    assert not engine.has_unfinished
