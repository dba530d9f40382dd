"""Sampler: greedy rows, the top-k/top-p/min-p filters and per-request seeds under batching."""

from __future__ import annotations

import pytest
import torch

from engine.sampler import Sampler, filter_logits
from engine.sampling_params import SamplingParams


def random_logits(num_rows: int, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_greedy_rows_take_the_argmax() -> None:
    logits = random_logits(5)
    params = [SamplingParams(temperature=0.0)] * 5
    out = Sampler(seed=1)(logits, params, [None] * 5, return_logprobs=True)
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    expected = torch.log_softmax(logits, -1).max(dim=-1).values
    assert out.logprobs == pytest.approx(expected.tolist(), abs=1e-6)


def test_greedy_ties_take_the_first_maximum_over_a_full_vocabulary() -> None:
    """A vocabulary-sized row with equal maxima (and one NaN row) picks what argmax picks: the
    first maximum, the NaN."""
    logits = random_logits(6, vocab=49152, seed=4)
    for row, columns in enumerate([[3, 40000], [40000, 3], [17, 18, 49151], [49151]]):
        logits[row, columns] = 100.0
    logits[4, 9000] = float("nan")
    params = [SamplingParams(temperature=0.0)] * 6
    out = Sampler(seed=1)(logits, params, [None] * 6)
    assert out.token_ids[:5] == [3, 3, 17, 49151, 9000]
    assert out.token_ids == logits.argmax(dim=-1).tolist()


def test_top_k_keeps_exactly_the_k_best() -> None:
    logits = random_logits(3)
    kept = filter_logits(logits, [SamplingParams(top_k=k) for k in (1, 5, 50)])
    for row, k in enumerate((1, 5, 50)):
        finite = torch.isfinite(kept[row]).nonzero().flatten()
        assert set(finite.tolist()) == set(logits[row].topk(k).indices.tolist())


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    logits = random_logits(4)
    for top_p in (0.1, 0.5, 0.9):
        kept = filter_logits(logits, [SamplingParams(top_p=top_p)] * 4)
        for row in range(4):
            probs = torch.softmax(logits[row], -1)
            order = probs.argsort(descending=True)
            cumulative = probs[order].cumsum(0)
            num_needed = int((cumulative < top_p).sum()) + 1
            assert set(torch.isfinite(kept[row]).nonzero().flatten().tolist()) == set(
                order[:num_needed].tolist()
            )


def test_min_p_never_samples_below_the_threshold() -> None:
    logits = random_logits(1, vocab=20)
    probs = torch.softmax(logits[0], -1)
    allowed = set((probs >= 0.2 * probs.max()).nonzero().flatten().tolist())
    sampler = Sampler(seed=3)
    params = [SamplingParams(temperature=1.0, min_p=0.2)] * 64
    tokens = sampler(logits.expand(64, -1), params, [None] * 64).token_ids
    assert set(tokens) <= allowed
    assert len(set(tokens)) > 1  # still random among the allowed ones


def test_sampling_follows_the_distribution() -> None:
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    params = [SamplingParams(temperature=1.0)] * 4000
    tokens = Sampler(seed=5)(logits.expand(4000, -1), params, [None] * 4000).token_ids
    freq = torch.bincount(torch.tensor(tokens), minlength=3).float() / 4000
    assert freq.tolist() == pytest.approx([0.7, 0.2, 0.1], abs=0.03)


def test_seeded_request_is_reproducible_whatever_its_batch() -> None:
    logits = random_logits(6)
    mine = SamplingParams(temperature=1.3, top_p=0.95, top_k=30, seed=42)
    other = SamplingParams(temperature=0.8)
    alone = [Sampler()(logits[2:3], [mine], [seeded(42)]).token_ids[0] for _ in range(1)]
    gen_alone = seeded(42)
    seq_alone = [Sampler()(logits[2:3], [mine], [gen_alone]).token_ids[0] for _ in range(20)]
    gen_batched = seeded(42)
    seq_batched = []
    for step in range(20):
        rows = [other, mine, SamplingParams(temperature=0.0), other][: 2 + step % 3]
        gens: list[torch.Generator | None] = [None, gen_batched, None, None][: len(rows)]
        batch = torch.stack([logits[0], logits[2], logits[3], logits[4]][: len(rows)])
        seq_batched.append(Sampler()(batch, rows, gens).token_ids[1])
    assert seq_alone == seq_batched
    assert seq_alone[0] == alone[0]
    assert len(set(seq_alone)) > 1  # it really samples


def test_unseeded_rows_differ_between_samplers() -> None:
    logits = torch.zeros(1, 1000)
    params = [SamplingParams(temperature=1.0)]
    draws = {Sampler()(logits, params, [None]).token_ids[0] for _ in range(5)}
    assert len(draws) > 1


def test_row_count_mismatch_is_an_error() -> None:
    with pytest.raises(ValueError):
        Sampler()(random_logits(2), [SamplingParams()], [None, None])
