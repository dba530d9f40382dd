"""The step budget: the TPOT target's decodes and prompt room, the time a prompt needs to its
first token, the derived default, and the scale that follows measured steps."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.scheduler.budget import DEFAULT_TTFT_S, StepBudget, StepCosts

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


def test_the_room_shrinks_as_decodes_grow_and_prompts_always_move() -> None:
    budget = StepBudget(0.050, COSTS, min_prefill_tokens=16)
    # 40 ms beyond the fixed cost; a page of prompt (8 ms) always fits beside the decodes.
    assert budget.max_decodes(64) == 16
    assert budget.max_decodes(8) == 8  # never more than the slots
    assert budget.prefill_room(0, 2048) == 80
    assert budget.prefill_room(10, 2048) == 40  # 20 ms left, at 0.5 ms a token
    assert budget.prefill_room(20, 2048) == 16  # nothing left: the minimum
    assert budget.prefill_room(0, 30) == 30  # never more than the token budget
    assert StepBudget(0.001, COSTS).max_decodes(64) == 1  # below one decode: one at a time
    # Without a target (or measured costs) a step may take the whole token budget.
    assert StepBudget().prefill_room(50, 2048) == 2048 and StepBudget().max_decodes(64) == 64


def test_a_prompt_needs_more_time_to_its_first_token_beside_more_decodes() -> None:
    budget = StepBudget(0.050, COSTS)
    alone = budget.horizon_s(200, 0, 2048)
    busy = budget.horizon_s(200, 10, 2048)
    # Beside 10 decodes: 40 tokens a step, 1 + 5 steps of 30 ms, plus 200 tokens' own 100 ms.
    assert busy == pytest.approx(6 * 0.030 + 0.100)
    assert alone < busy
    assert StepBudget().horizon_s(200, 10, 2048) == 0.0  # nothing measured: no estimate
    assert StepBudget().ttft_s == DEFAULT_TTFT_S == 2.0


def test_slow_rows_raise_the_scale_and_shrink_what_fits_but_not_the_fixed_cost() -> None:
    budget = StepBudget(0.050, COSTS)
    for _ in range(200):
        budget.observe(20, 0, 0.010 + 2 * 20 * 0.002)  # decodes twice the model (long contexts)
    assert budget.scale == pytest.approx(2.0, rel=0.02)
    assert budget.predict_s(20, 0) == pytest.approx(0.090, rel=0.02)
    assert budget.max_decodes(64) == 6  # (50 - 10 - 2 x 8 ms of a page) / (2 x 2 ms)
    assert budget.prefill_room(5, 2048) == 20  # (50 - 10 - 2 x 10 ms) / (2 x 0.5 ms)
    for _ in range(200):  # the same rows again, on a machine whose steps are all as modelled
        budget.observe(20, 0, 0.010 + 20 * 0.002)
    assert budget.scale == pytest.approx(1.0, rel=0.02)
    one_outlier = StepBudget(0.050, COSTS)
    one_outlier.observe(20, 0, 10.0)  # one stalled step moves the scale by a few percent only
    assert one_outlier.scale < 1.5
    unchanged = StepBudget(0.050, COSTS)
    unchanged.observe(0, 0, 1.0)
    unchanged.observe(3, 0, 0.0)
    assert unchanged.scale == 1.0


@pytest.mark.parametrize(
    ("fixed", "decode", "token"),
    [(-1.0, 0.1, 0.1), (0.1, 0.0, 0.1), (0.1, 0.1, 0.0), (float("nan"), 0.1, 0.1)],
)
def test_costs_refuse_values_that_cannot_be_a_machine(
    fixed: float, decode: float, token: float
) -> None:
    with pytest.raises(ValueError):
        StepCosts(fixed, decode, token)


@pytest.mark.parametrize("seconds", [0.0, -0.01, float("inf")])
def test_targets_must_be_positive_times(seconds: float) -> None:
    with pytest.raises(ValueError):
        StepBudget(seconds, COSTS)
    with pytest.raises(ValueError):
        StepBudget(0.05, COSTS, ttft_s=seconds)


@pytest.mark.parametrize("value", [0.0, -1.0, float("inf"), float("nan")])
def test_the_engine_config_refuses_a_target_that_is_not_a_positive_time(value: float) -> None:
    with pytest.raises(ValueError, match="target_tpot_ms"):
        EngineConfig(target_tpot_ms=value)
    with pytest.raises(ValueError, match="target_ttft_ms"):
        EngineConfig(target_ttft_ms=value)
    assert EngineConfig(target_tpot_ms="auto").target_tpot_ms == "auto"
    assert EngineConfig().target_ttft_ms == 2000.0
