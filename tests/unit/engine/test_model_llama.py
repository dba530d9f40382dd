"""Our Llama over the paged cache against transformers on the same tiny random weights."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM as HFLlama

from engine.attention.metadata import SeqSlice, build_attention_metadata
from engine.attention.torch_backend import TorchAttentionBackend
from engine.model.loader import LoadedModel, load_model
from tests.support.paged import PagedRunner, PagedSeq
from tests.support.tiny_llama import load_reference, make_tiny_llama

ATOL = 1e-4


def hf_logits(hf: HFLlama, tokens: list[int]) -> torch.Tensor:  # [len(tokens), vocab]
    with torch.no_grad():
        out: torch.Tensor = hf(torch.tensor([tokens])).logits[0].float()
    return out


def random_tokens(n: int, seed: int, vocab: int = 256) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


def shuffled_pages(num_pages: int, seed: int) -> list[int]:
    pages = list(range(num_pages))
    random.Random(seed).shuffle(pages)
    return pages


@pytest.fixture(scope="module")
def ours(tiny_llama_dir: Path) -> LoadedModel:
    return load_model(str(tiny_llama_dir), dtype=torch.float32)


@pytest.fixture(scope="module")
def hf(tiny_llama_dir: Path) -> HFLlama:
    return load_reference(tiny_llama_dir, torch.float32)


def test_whole_prompt_matches_transformers(ours: LoadedModel, hf: HFLlama) -> None:
    tokens = random_tokens(37, seed=1)
    meta = build_attention_metadata([SeqSlice([3, 0, 2], 0, len(tokens))], page_size=16)
    runner = PagedRunner(ours.model, TorchAttentionBackend(), num_pages=4, page_size=16)
    logits = ours.model(
        torch.tensor(tokens),
        torch.arange(len(tokens)),
        meta,
        runner.backend,
        runner.kv_caches,
        torch.arange(len(tokens)),
    )
    expected = hf_logits(hf, tokens)
    assert logits.dtype == torch.float32
    assert logits.shape == expected.shape
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))


def test_the_last_layer_runs_only_the_sampled_rows(ours: LoadedModel, hf: HFLlama) -> None:
    """The last layer's output projection and MLP take only the rows whose logits are asked
    for; every row's K/V is still written (the cache equals the all-rows run's), the logits
    asked for equal those rows of transformers', and a step that samples nothing returns none."""
    tokens = random_tokens(37, seed=4)
    meta = build_attention_metadata([SeqSlice([1, 3, 0], 0, len(tokens))], page_size=16)
    caches = []
    outputs = []
    for rows in (
        torch.arange(len(tokens)),
        torch.tensor([36, 5, 20]),
        torch.tensor([], dtype=torch.int64),
    ):
        runner = PagedRunner(ours.model, TorchAttentionBackend(), num_pages=4, page_size=16)
        outputs.append(
            ours.model(
                torch.tensor(tokens),
                torch.arange(len(tokens)),
                meta,
                runner.backend,
                runner.kv_caches,
                rows,
            )
        )
        caches.append(runner.kv_caches)
    every, some, none = outputs
    expected = hf_logits(hf, tokens)
    torch.testing.assert_close(some, expected[[36, 5, 20]], atol=ATOL, rtol=0)
    torch.testing.assert_close(some, every[[36, 5, 20]], atol=1e-5, rtol=0)
    assert none.shape == (0, expected.shape[1])
    for cache in caches[1:]:
        for theirs, mine in zip(caches[0], cache, strict=True):
            assert torch.equal(theirs[[1, 3, 0]], mine[[1, 3, 0]])


@pytest.mark.parametrize("page_size", [4, 16])
@pytest.mark.parametrize("chunk_sizes", [[1, 2, 3, 5, 8, 13, 21], [7, 7, 7, 7, 7, 7, 7, 11]])
def test_chunked_prefill_over_shuffled_pages(
    ours: LoadedModel, hf: HFLlama, page_size: int, chunk_sizes: list[int]
) -> None:
    tokens = random_tokens(sum(chunk_sizes), seed=page_size)
    num_pages = -(-len(tokens) // page_size) + 3
    runner = PagedRunner(ours.model, TorchAttentionBackend(), num_pages, page_size)
    seq = PagedSeq(tokens, shuffled_pages(num_pages, seed=7))
    for n in chunk_sizes:
        runner.step([seq], [n])
    expected = hf_logits(hf, tokens)
    ends = torch.tensor(chunk_sizes).cumsum(0) - 1
    got = torch.stack(seq.logits)
    torch.testing.assert_close(got, expected[ends], atol=ATOL, rtol=0)
    assert torch.equal(got.argmax(-1), expected[ends].argmax(-1))


@pytest.mark.parametrize("page_size", [4, 16])
def test_batched_decodes_with_mixed_lengths(ours: LoadedModel, hf: HFLlama, page_size: int) -> None:
    prompt_lens = [1, 5, 17, 33]
    pages_each = -(-(max(prompt_lens) + 8) // page_size)
    pages = shuffled_pages(pages_each * len(prompt_lens), seed=3)
    runner = PagedRunner(ours.model, TorchAttentionBackend(), len(pages), page_size)
    seqs = [
        PagedSeq(random_tokens(n, seed=10 + i), pages[i * pages_each : (i + 1) * pages_each])
        for i, n in enumerate(prompt_lens)
    ]
    # All prompts prefilled in one mixed step, then greedy decodes of the whole batch.
    runner.step(seqs, prompt_lens)
    for seq in seqs:
        seq.tokens.append(int(seq.logits[-1].argmax()))
    for _ in range(6):
        runner.step(seqs, [1] * len(seqs))
        for seq in seqs:
            seq.tokens.append(int(seq.logits[-1].argmax()))
    for seq, n in zip(seqs, prompt_lens, strict=True):
        expected = hf_logits(hf, seq.tokens[:-1])[n - 1 :]
        got = torch.stack(seq.logits)
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
        assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_decodes_and_a_prefill_chunk_in_one_step(ours: LoadedModel, hf: HFLlama) -> None:
    runner = PagedRunner(ours.model, TorchAttentionBackend(), num_pages=24, page_size=4)
    pages = shuffled_pages(24, seed=5)
    a = PagedSeq(random_tokens(9, seed=21), pages[:8])
    b = PagedSeq(random_tokens(20, seed=22), pages[8:16])
    runner.step([a], [8])  # a has one token left to decode
    runner.step([b], [6])  # b has a prefix in the cache and 14 tokens to go
    runner.step([a, b], [1, 14])
    for seq in (a, b):
        expected = hf_logits(hf, seq.tokens)[-1]
        torch.testing.assert_close(seq.logits[-1], expected, atol=ATOL, rtol=0)


def test_bfloat16_agrees_with_transformers_bfloat16(tiny_llama_dir: Path) -> None:
    ours = load_model(str(tiny_llama_dir), dtype=torch.bfloat16)
    hf = load_reference(tiny_llama_dir, torch.bfloat16)
    tokens = random_tokens(48, seed=4)
    runner = PagedRunner(ours.model, TorchAttentionBackend(), num_pages=4, page_size=16)
    seq = PagedSeq(tokens, [2, 0, 3, 1])
    for n in [16, 16, 1, 1, 1, 13]:
        runner.step([seq], [n])
    ends = torch.tensor([15, 31, 32, 33, 34, 47])
    expected = hf_logits(hf, tokens)[ends]
    got = torch.stack(seq.logits)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
    diff = (got.log_softmax(-1) - expected.log_softmax(-1)).abs().max()
    assert diff < 0.05


@pytest.mark.parametrize(
    "overrides",
    [
        {"tie_word_embeddings": True},
        {"rope_scaling": {"rope_type": "linear", "factor": 4.0}},
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            "rope_theta": 500000.0,
        },
    ],
    ids=["tied", "rope-linear", "rope-llama3"],
)
def test_variants_match_transformers(tmp_path: Path, overrides: dict[str, object]) -> None:
    model_dir = make_tiny_llama(tmp_path / "m", seed=3, **overrides)
    ours = load_model(str(model_dir), dtype=torch.float32)
    hf = load_reference(model_dir, torch.float32)
    if overrides.get("tie_word_embeddings"):
        assert ours.model.lm_head is None
    scaling = overrides.get("rope_scaling")
    if isinstance(scaling, dict):
        assert ours.config.rope_scaling is not None
        assert ours.config.rope_scaling["rope_type"] == scaling["rope_type"]
    tokens = random_tokens(200, seed=9)
    runner = PagedRunner(ours.model, TorchAttentionBackend(), num_pages=16, page_size=16)
    seq = PagedSeq(tokens, shuffled_pages(16, seed=1))
    for n in [150, 49, 1]:
        runner.step([seq], [n])
    expected = hf_logits(hf, tokens)[torch.tensor([149, 198, 199])]
    torch.testing.assert_close(torch.stack(seq.logits), expected, atol=ATOL, rtol=0)
