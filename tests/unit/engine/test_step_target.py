"""The step-time target: what fits in a step, the derived default, and the running scales."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.step_target import StepCosts, StepTarget

COSTS = StepCosts(fixed_s=0.010, per_decode_s=0.002, per_prefill_token_s=0.0005)


def test_the_derived_target_keeps_the_asked_share_of_the_best_decode_throughput() -> None:
    target_s = COSTS.auto_target_s(0.8)
    assert target_s == pytest.approx(0.050)
    decodes = 20  # the batch whose step takes the target: 10 ms + 20 x 2 ms
    best = 1 / COSTS.per_decode_s
    reached = decodes / (COSTS.fixed_s + COSTS.per_decode_s * decodes)
    assert reached / best == pytest.approx(0.8)
    # Never below what one decode alone takes.
    assert StepCosts(0.0, 0.004, 0.001).auto_target_s() == pytest.approx(0.004)


def test_decodes_and_prefill_fill_the_target_and_prefill_always_moves() -> None:
    target = StepTarget(0.050, COSTS, min_prefill_tokens=16)
    # 40 ms beyond the fixed cost: decodes take at most three quarters of it.
    assert target.max_decodes == 15
    assert target.prefill_budget(15) == 20  # the quarter left, at 0.5 ms a token
    assert target.prefill_budget(10) == 40  # 20 ms left
    assert target.prefill_budget(20) == 16  # nothing left: the minimum
    assert target.prefill_budget(100) == 16
    assert StepTarget(0.001, COSTS).max_decodes == 1  # a target below one decode: one at a time


def test_slow_rows_raise_the_scale_and_shrink_what_fits_but_not_the_fixed_cost() -> None:
    target = StepTarget(0.050, COSTS)
    for _ in range(200):
        target.observe(20, 0, 0.010 + 2 * 20 * 0.002)  # decodes twice the model (long contexts)
    assert target.scale == pytest.approx(2.0, rel=0.02)
    assert target.predict_s(20, 0) == pytest.approx(0.090, rel=0.02)
    assert target.max_decodes == 7  # (50 ms - 10 ms) x 3/4 / (2 x 2 ms)
    # Decode-only steps say nothing of prompts: their tokens still cost 0.5 ms.
    assert target.prefill_scale == 1.0
    assert target.prefill_budget(5) == 40  # (50 - 10 - 2 x 10 ms) / 0.5 ms
    # Scaling the fixed cost as well would have left (25 - 10) x 3/4 / 2 = 5 decodes.
    for _ in range(200):  # the same rows again, on a machine whose steps are all as modelled
        target.observe(20, 0, 0.010 + 20 * 0.002)
    assert target.scale == pytest.approx(1.0, rel=0.02)
    one_outlier = StepTarget(0.050, COSTS)
    one_outlier.observe(20, 0, 10.0)  # one stalled step moves the scale by a few percent only
    assert one_outlier.scale < 1.5
    unchanged = StepTarget(0.050, COSTS)
    unchanged.observe(0, 0, 1.0)
    unchanged.observe(3, 0, 0.0)
    assert unchanged.scale == 1.0


def test_long_contexts_cost_decodes_but_leave_the_prompts_share_alone() -> None:
    # 1 us a context token: a decode over 1,000 tokens costs 3 ms, not 2.
    costs = StepCosts(0.010, 0.002, 0.0005, per_context_token_s=0.000001)
    target = StepTarget(0.050, costs, min_prefill_tokens=4)
    for _ in range(200):  # steps of 10 decodes over 1,000 tokens each, all as modelled
        target.observe(10, 0, 0.010 + 10 * 0.003, num_context_tokens=10 * 1000)
    assert target.scale == pytest.approx(1.0, rel=0.02)
    assert target.context_per_decode == pytest.approx(1000, rel=0.02)
    assert target.max_decodes == 10  # (50 ms - 10 ms) x 3/4 / 3 ms
    assert target.prefill_budget(10) == pytest.approx(20, abs=1)  # 10 ms left at 0.5 ms a token
    # Without the context cost the same steps read as decodes 1.5 times the model: the same
    # batch fits, and the prompts' scale is not theirs to move.
    blind = StepTarget(0.050, COSTS, min_prefill_tokens=4)
    for _ in range(200):
        blind.observe(10, 0, 0.010 + 10 * 0.003)
    assert blind.scale == pytest.approx(1.5, rel=0.02)
    assert blind.prefill_scale == 1.0
    assert blind.prefill_budget(10) == pytest.approx(20, abs=1)


def test_each_scale_follows_the_steps_its_rows_take() -> None:
    # A lone decode costs three times the model (Python and launches), prompt tokens 1.3 times
    # (chunks deep into long prompts): one scale would plan prompts at the decodes' error.
    decode_cost, token_cost = 3 * 0.002, 1.3 * 0.0005
    target = StepTarget(0.050, COSTS)
    for _ in range(300):
        target.observe(1, 0, 0.010 + decode_cost)  # a decode alone
        target.observe(0, 400, 0.010 + 400 * token_cost)  # a prompt alone
        target.observe(1, 60, 0.010 + decode_cost + 60 * token_cost)  # the two together
    assert target.scale == pytest.approx(3.0, rel=0.03)
    assert target.prefill_scale == pytest.approx(1.3, rel=0.03)
    assert target.predict_s(1, 60) == pytest.approx(0.010 + decode_cost + 60 * token_cost, rel=0.02)
    # 50 ms - 10 ms - 6 ms left for prompt tokens at 0.65 ms.
    assert target.prefill_budget(1) == 52
    # A mixed step whose error lies all in its prompts moves the prompts' scale the most.
    mixed = StepTarget(0.050, COSTS)
    for _ in range(300):
        mixed.observe(4, 80, 0.010 + 4 * 0.002 + 80 * 2 * 0.0005)
    assert mixed.prefill_scale > 1.7
    assert mixed.scale < mixed.prefill_scale
    assert mixed.predict_s(4, 80) == pytest.approx(0.010 + 4 * 0.002 + 80 * 0.001, rel=0.02)


@pytest.mark.parametrize(
    ("fixed", "decode", "token"),
    [(-1.0, 0.1, 0.1), (0.1, 0.0, 0.1), (0.1, 0.1, 0.0), (float("nan"), 0.1, 0.1)],
)
def test_costs_refuse_values_that_cannot_be_a_machine(
    fixed: float, decode: float, token: float
) -> None:
    with pytest.raises(ValueError):
        StepCosts(fixed, decode, token)
    for context in (-1e-6, float("inf")):
        with pytest.raises(ValueError):
            StepCosts(0.1, 0.1, 0.1, per_context_token_s=context)


@pytest.mark.parametrize("target_s", [0.0, -0.01, float("inf")])
def test_a_target_must_be_a_positive_time(target_s: float) -> None:
    with pytest.raises(ValueError):
        StepTarget(target_s, COSTS)


@pytest.mark.parametrize("value", [0.0, -1.0, float("inf"), float("nan")])
def test_the_engine_config_refuses_a_target_that_is_not_a_positive_time(value: float) -> None:
    with pytest.raises(ValueError, match="target_tpot_ms"):
        EngineConfig(target_tpot_ms=value)
    assert EngineConfig(target_tpot_ms="auto").target_tpot_ms == "auto"
