"""Greedy outputs of the engine are token-identical to transformers on the same weights (fp32)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from engine.model.export import export_hf
from engine.model.loader import LoadedModel, load_model
from tests.support.greedy import engine_greedy, hf_greedy

NUM_NEW = 10


@pytest.fixture(scope="module")
def tiny_pair(tiny_llama_dir: Path) -> tuple[LoadedModel, list[list[int]], list[list[int]]]:
    loaded = load_model(str(tiny_llama_dir), dtype=torch.float32)
    hf = LlamaForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()  # type: ignore[no-untyped-call]
    prompts = [[(i * 31 + j * 7) % 256 for j in range(3 + 17 * i)] for i in range(8)]
    return loaded, prompts, hf_greedy(hf, prompts, NUM_NEW)


@pytest.mark.parametrize("budget", [16, 64, 512])
@pytest.mark.parametrize("batch", [1, 8])
def test_greedy_matches_transformers_across_budgets(
    tiny_pair: tuple[LoadedModel, list[list[int]], list[list[int]]], budget: int, batch: int
) -> None:
    loaded, prompts, expected = tiny_pair
    chosen = [prompts[5]] if batch == 1 else prompts  # 88 tokens: several chunks at budget 16
    want = [expected[5]] if batch == 1 else expected
    got, _ = engine_greedy(
        loaded, chosen, NUM_NEW, num_pages=64, max_num_batched_tokens=budget, max_num_seqs=8
    )
    assert got == want


def test_greedy_matches_transformers_after_forced_preemption(
    tiny_pair: tuple[LoadedModel, list[list[int]], list[list[int]]],
) -> None:
    loaded, prompts, expected = tiny_pair
    got, num_preemptions = engine_greedy(
        loaded, prompts, NUM_NEW, page_size=4, num_pages=40, max_num_batched_tokens=64
    )
    assert num_preemptions > 0
    assert got == expected


CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain recursion to a child.",
    "List three prime numbers.",
    "Translate 'good morning' into Spanish.",
    "Why is the sky blue?",
    "Give me a tip for learning Python.",
    "What is 12 times 12?",
]


@pytest.mark.slow
def test_smollm2_chat_matches_transformers(
    default_model_fp32: LoadedModel, tmp_path_factory: pytest.TempPathFactory
) -> None:
    loaded = default_model_fp32
    export_dir = tmp_path_factory.mktemp("smollm2")
    export_hf(loaded, export_dir)
    hf = LlamaForCausalLM.from_pretrained(export_dir, dtype=torch.float32).eval()  # type: ignore[no-untyped-call]
    tok = loaded.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in CHAT_PROMPTS]
    # With the prefix cache on: the template's system prompt is shared, so later prompts hit.
    got, _ = engine_greedy(
        loaded, prompts, 32, prefix_cache=True, num_pages=128, max_num_batched_tokens=512
    )
    assert got == hf_greedy(hf, prompts, 32)
