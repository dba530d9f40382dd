"""Sampler at the edges of its parameters and logits: valid token ids, never a NaN's choice."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.sampler import Sampler
from engine.sampling_params import GREEDY_TEMPERATURE, SamplingParams

VOCAB = 64
TEMPERATURES = (0.0, 1e-300, 1e-30, 1e-6, GREEDY_TEMPERATURE, 1e-4, 0.7, 2.0)
TOP_PS = (1e-300, 1e-40, 1e-6, 0.5, 1.0)
TOP_KS = (-1, 0, 1, 2, VOCAB - 1, VOCAB, 10 * VOCAB)
MIN_PS = (0.0, 1e-300, 1e-6, 0.5, 1.0)
SEPARATED_ROWS = (0, 3, 4)  # rows whose best token's probability stands apart at any temperature


def extreme_logits(seed: int) -> torch.Tensor:
    """Eight rows: plain, huge, tiny, spiky, with -inf, with NaN and with +inf entries."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(8, VOCAB, generator=g)
    rows[1] *= 1e30
    rows[2] *= 1e-30
    rows[3, 5] = 1e4
    rows[4, VOCAB // 2 :] = float("-inf")
    rows[5, ::3] = float("nan")
    rows[6, 7] = float("inf")
    rows[7, :] = torch.finfo(torch.float32).max
    return rows


def finite_best(row: torch.Tensor) -> set[int]:
    """The tokens a near-greedy choice may take: the largest non-NaN logits."""
    clean = torch.nan_to_num(row, nan=float("-inf"))
    return set((clean == clean.max()).nonzero().flatten().tolist())


def check_choices(logits: torch.Tensor, params: SamplingParams, seed: int) -> None:
    rows = logits.shape[0]
    generators: list[torch.Generator | None] = [torch.Generator().manual_seed(seed)] * rows
    out = Sampler(seed=seed)(logits, [params] * rows, generators, return_logprobs=False)
    for row, token in enumerate(out.token_ids):
        assert 0 <= token < VOCAB
        if params.is_greedy:  # greedy is argmax, NaN and all (the model's, not a parameter's)
            assert token == int(logits[row].argmax())
            continue
        logit = float(logits[row, token])
        assert logit == logit, f"row {row} chose a NaN logit with {params}"
        if torch.isfinite(torch.nan_to_num(logits[row], nan=float("-inf"))).any():
            assert logit != float("-inf"), f"row {row} chose a filtered token with {params}"
        only_best = params.top_k == 1 or params.top_p < 1e-30
        if only_best or (params.min_p == 1.0 and row in SEPARATED_ROWS):
            assert token in finite_best(logits[row]), (row, params)


@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_every_filter_combination_gives_a_valid_token(temperature: float) -> None:
    logits = extreme_logits(seed=int(temperature * 1e6) % 97)
    for top_p, top_k, min_p in itertools.product(TOP_PS, TOP_KS, MIN_PS):
        params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p)
        params.validate()
        check_choices(logits, params, seed=3)


@pytest.mark.parametrize("temperature", [1e-300, 1e-45, 1e-10, 9.99e-6])
def test_temperatures_below_the_epsilon_are_greedy(temperature: float) -> None:
    params = SamplingParams(temperature=temperature)
    assert params.is_greedy
    logits = torch.randn(16, VOCAB, generator=torch.Generator().manual_seed(1)) * 3
    tokens = Sampler(seed=0)(logits, [params] * 16, [None] * 16).token_ids
    assert tokens == logits.argmax(dim=-1).tolist()


def test_the_smallest_sampled_temperature_still_picks_the_clear_best() -> None:
    params = SamplingParams(temperature=GREEDY_TEMPERATURE, seed=9)
    assert not params.is_greedy
    logits = torch.randn(16, VOCAB, generator=torch.Generator().manual_seed(2)) * 3
    tokens = Sampler(seed=0)(logits, [params] * 16, [None] * 16).token_ids
    assert tokens == logits.argmax(dim=-1).tolist()


@settings(max_examples=150, deadline=None)
@given(
    temperature=st.one_of(st.sampled_from(TEMPERATURES), st.floats(0.0, 2.0)),
    top_p=st.one_of(st.sampled_from(TOP_PS), st.floats(0.0, 1.0, exclude_min=True)),
    top_k=st.integers(-1, 2 * VOCAB),
    min_p=st.one_of(st.sampled_from(MIN_PS), st.floats(0.0, 1.0)),
    seed=st.integers(0, 2**31),
)
def test_random_parameters_never_choose_a_nan_or_filtered_token(
    temperature: float, top_p: float, top_k: int, min_p: float, seed: int
) -> None:
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p)
    params.validate()
    check_choices(extreme_logits(seed % 13), params, seed)
