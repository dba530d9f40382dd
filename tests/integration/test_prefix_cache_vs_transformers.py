"""Prefix-cache hits change nothing in the output: greedy ids equal transformers' (fp32) with
hits ending mid-page and mid-chunk, at any budget, after preemption, and shared prefixes that
arrive together are computed once."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from engine.attention import torch_backend
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model.loader import LoadedModel, load_model
from radix_cache.radix_prefix_cache import RadixPrefixCache
from tests.support.greedy import engine_greedy, hf_greedy, run_greedy
from tests.support.tiny_llama import make_tiny_llama

NUM_NEW = 8
SYSTEM = [(7 * j + 3) % 250 + 1 for j in range(45)]  # 2 full pages of 16 and 13 tokens more


def prompts() -> list[list[int]]:
    # Shared system part, then distinct questions: hits end inside the third page.
    return [[*SYSTEM, *[(i * 13 + j) % 250 + 1 for j in range(5 + 9 * i)]] for i in range(6)]


@pytest.fixture(scope="module")
def tiny_pair(tiny_llama_dir: Path) -> tuple[LoadedModel, list[list[int]]]:
    loaded = load_model(str(tiny_llama_dir), dtype=torch.float32)
    hf = LlamaForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()  # type: ignore[no-untyped-call]
    return loaded, hf_greedy(hf, prompts(), NUM_NEW)


@pytest.mark.parametrize("budget", [16, 40, 512])
def test_hits_give_the_same_tokens_at_any_budget(
    tiny_pair: tuple[LoadedModel, list[list[int]]], budget: int
) -> None:
    loaded, expected = tiny_pair
    engine = LLMEngine(
        loaded,
        EngineConfig(dtype="float32", num_pages=64, max_num_batched_tokens=budget, max_num_seqs=8),
        prefix_cache_factory=RadixPrefixCache,
    )
    cold, cold_out = run_greedy(engine, prompts()[:1], NUM_NEW, tag="cold")
    warm, warm_out = run_greedy(engine, prompts(), NUM_NEW, tag="warm")
    assert cold == expected[:1]
    assert warm == expected
    assert cold_out[0].num_cached_tokens == 0
    # Every warm prompt reuses the system pages; the first one its whole cached history.
    assert all(out.num_cached_tokens >= 32 for out in warm_out)
    engine.cache.check_integrity()


def test_hits_survive_preemption(tiny_pair: tuple[LoadedModel, list[list[int]]]) -> None:
    loaded, expected = tiny_pair
    got, num_preemptions = engine_greedy(
        loaded,
        prompts(),
        NUM_NEW,
        prefix_cache=True,
        page_size=4,
        num_pages=48,
        max_num_batched_tokens=32,
        max_num_seqs=8,
    )
    assert num_preemptions > 0
    assert got == expected


def test_a_long_prompt_arriving_twice_at_once_is_prefilled_once(tmp_path: Path) -> None:
    model_dir = make_tiny_llama(tmp_path / "long", max_position_embeddings=4096)
    loaded = load_model(str(model_dir), dtype=torch.float32)
    engine = LLMEngine(
        loaded,
        # A budget that fits both prompts in one step: without care both would be computed.
        EngineConfig(dtype="float32", num_pages=320, max_num_batched_tokens=4096, max_num_seqs=4),
        prefix_cache_factory=RadixPrefixCache,
    )
    prompt = [(j * 11) % 250 + 1 for j in range(2048)]
    got, outputs = run_greedy(engine, [prompt, prompt], 4)
    assert got[0] == got[1]
    # The second request waits for the first's chunks and then reuses all but its last page.
    assert engine.stats.num_prefill_tokens <= 2048 + 16
    assert outputs[1].num_cached_tokens == 2032


@pytest.mark.parametrize("budget", [16, 512])
def test_decodes_reading_shared_pages_once_give_the_same_tokens(
    tiny_pair: tuple[LoadedModel, list[list[int]]],
    monkeypatch: pytest.MonkeyPatch,
    budget: int,
) -> None:
    """With the shared-prefix split of decode attention always on, nothing changes."""
    monkeypatch.setattr(torch_backend, "CASCADE_MIN_SAVED_TOKENS", -(10**9))
    loaded, expected = tiny_pair
    engine = LLMEngine(
        loaded,
        EngineConfig(dtype="float32", num_pages=64, max_num_batched_tokens=budget, max_num_seqs=8),
        prefix_cache_factory=RadixPrefixCache,
    )
    run_greedy(engine, prompts()[:1], NUM_NEW, tag="cold")
    warm, _ = run_greedy(engine, prompts(), NUM_NEW, tag="warm")
    assert warm == expected
