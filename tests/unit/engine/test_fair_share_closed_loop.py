"""Weighted fair share over time: tenants keeping requests in flight get their weights' shares.

Over the slots, service converges to the weights whatever the arrival order and whatever the
tenants' requests cost (long prompts, long answers, cached prefixes), with or without a step
budget and first-token deadlines (on a virtual clock). Within the slots, a queue the TPOT target
forms never holds a first token past its deadline, and a flooder beside light tenants barely
moves their first tokens.
"""

from __future__ import annotations

import pytest

from engine.scheduler.budget import StepBudget, StepCosts
from tests.support.closed_loop import ClosedLoop, Shape

WEIGHTS = {"w1": 1.0, "w2": 2.0, "w4": 4.0}
ORDERS = [("w1", "w2", "w4"), ("w4", "w2", "w1")]
# Each tenant's requests cost differently: long uncached prompts and short answers, short
# prompts and long answers, a long cached system prompt with a short question.
MIXED = {"w1": Shape(0, 400, 16), "w2": Shape(0, 40, 100), "w4": Shape(320, 30, 48)}
SAME = {t: Shape(32, 64, 48) for t in WEIGHTS}


def start(loop: ClosedLoop, order: tuple[str, ...], in_flight: int, gap: int = 30) -> None:
    """Each tenant starts ``gap`` steps after the one before it; nothing is counted yet."""
    for tenant in order:
        loop.start(tenant, in_flight)
        loop.run(gap, count=False)


def assert_shares(shares: dict[str, float], tolerance: float = 0.05) -> None:
    for tenant, share in shares.items():
        assert share == pytest.approx(1.0, abs=tolerance), (tenant, shares)


# A machine whose step takes 10 ms plus 2 ms per decode and 0.5 ms per prefill token.
COSTS = StepCosts(fixed_s=0.010, per_decode_s=0.002, per_prefill_token_s=0.0005)
# A 2-core CPU's measured costs (12 ms a step, 0.75 ms a decode, 0.55 ms a prompt token).
CPU = StepCosts(fixed_s=0.012, per_decode_s=0.00075, per_prefill_token_s=0.00055)


def budget_for(as_served: bool) -> StepBudget | None:
    """The default policy on a 2-core CPU (the auto TPOT target, 2 s deadlines), or none."""
    return StepBudget(CPU.auto_target_s(), CPU) if as_served else None


@pytest.mark.parametrize("as_served", [False, True])
@pytest.mark.parametrize("order", ORDERS)
def test_over_the_slots_work_follows_the_weights_whatever_the_requests_cost(
    order: tuple[str, ...], as_served: bool
) -> None:
    loop = ClosedLoop(WEIGHTS, MIXED, max_num_seqs=32, budget_model=budget_for(as_served))
    start(loop, order, in_flight=24)
    loop.run(1500, count=False)  # the first tenant's head start is behind us
    loop.run(2000)
    assert_shares(loop.shares(loop.work))


@pytest.mark.parametrize("as_served", [False, True])
@pytest.mark.parametrize("order", ORDERS)
def test_over_the_slots_a_late_light_tenant_gets_its_share_of_tokens(
    order: tuple[str, ...], as_served: bool
) -> None:
    loop = ClosedLoop(
        WEIGHTS, SAME, max_num_seqs=32, num_pages=900, budget_model=budget_for(as_served)
    )  # tight: pages run out too
    start(loop, order, in_flight=24)
    loop.run(600, count=False)
    loop.run(1500)
    assert_shares(loop.shares(loop.tokens))


@pytest.mark.parametrize("order", ORDERS)
def test_within_the_slots_a_queue_the_target_forms_holds_no_first_token_past_its_deadline(
    order: tuple[str, ...],
) -> None:
    # A 50 ms target holds 16 decodes; 3 x 10 requests fit the 32 slots. The others queue, where
    # the counters order them, until a deadline (0.5 s) is due: then they run beyond the 16.
    model = StepBudget(0.050, COSTS, ttft_s=0.5)
    loop = ClosedLoop(WEIGHTS, SAME, max_num_seqs=32, budget_model=model)
    start(loop, order, in_flight=10)
    loop.run(1200)
    assert loop.max_running > model.max_decodes(32) == 16
    # A step in flight when it fell due, and one more when another request of its tenant was
    # computing its shared prefix (it waits for those pages rather than computing them twice).
    longest_step = model.predict_s(32, 512)
    for tenant, waits in loop.first_token_s.items():
        assert max(waits) <= 0.5 + 2 * longest_step, tenant


def test_with_no_decode_running_prompts_take_the_whole_budget_and_beside_decodes_the_room() -> None:
    model = StepBudget(0.050, COSTS)  # 80 prefill tokens fit beside no decode
    loop = ClosedLoop(WEIGHTS, {t: Shape(0, 300, 4) for t in WEIGHTS}, 8, budget_model=model)
    for tenant in WEIGHTS:
        loop.start(tenant, 1)
    assert loop.scheduler.schedule().num_batched_tokens == 512  # no decode: no TPOT at stake
    assert model.prefill_room(4, 512) < 512


LIGHT = {"t1": 1.0, "t2": 1.0, "t3": 1.0}


def light_first_tokens(flooder: bool) -> dict[str, list[float]]:
    """Three light tenants with 2 requests in flight (and a flooder with 32), all arriving at
    once, 1,200 steps under the default policy; each light tenant's times to first token."""
    weights = {**LIGHT, "flood": 1.0}
    shapes = {t: Shape(0, 120, 48) for t in weights}
    loop = ClosedLoop(weights, shapes, max_num_seqs=64, budget_model=budget_for(True))
    for tenant in LIGHT:
        loop.start(tenant, 2)
    if flooder:
        loop.start("flood", 32)
    loop.run(1200)
    assert flooder == (loop.tokens["flood"] > 0)
    return {t: loop.first_token_s[t] for t in LIGHT}


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def test_a_flooder_at_sixteen_times_their_concurrency_barely_moves_light_first_tokens() -> None:
    calm = light_first_tokens(flooder=False)
    flood = light_first_tokens(flooder=True)
    typical = {t: median(flood[t]) / median(calm[t]) for t in LIGHT}
    # The flood's decodes do not shorten a less-served prompt's room, so a light prompt takes as
    # many steps as alone (each step longer by the flood's decodes); and none waits past its
    # deadline (the counters alone share the first burst with the flood evenly).
    assert all(r <= 1.3 for r in typical.values()), typical
    assert all(max(flood[t]) <= 2.0 for t in LIGHT), {t: max(flood[t]) for t in LIGHT}
