"""Weighted fair share over time: tenants keeping requests in flight get their weights' shares.

Over the slots, service converges to the weights whatever the arrival order and whatever the
tenants' requests cost (long prompts, long answers, cached prefixes). Within the slots, a
step-time target holds fewer requests running, so a queue forms and the weights act there too.
A flooder beside light tenants barely moves their first tokens (on a virtual clock).
"""

from __future__ import annotations

import pytest

from engine.fair_share import FairSharePolicy
from engine.step_target import StepCosts, StepTarget
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


@pytest.mark.parametrize("order", ORDERS)
def test_over_the_slots_work_follows_the_weights_whatever_the_requests_cost(
    order: tuple[str, ...],
) -> None:
    loop = ClosedLoop(WEIGHTS, MIXED, max_num_seqs=32)
    start(loop, order, in_flight=24)
    loop.run(1500, count=False)  # the first tenant's head start is behind us
    loop.run(2000)
    assert_shares(loop.shares(loop.work))


@pytest.mark.parametrize("order", ORDERS)
def test_over_the_slots_a_late_light_tenant_gets_its_share_of_tokens(
    order: tuple[str, ...],
) -> None:
    loop = ClosedLoop(WEIGHTS, SAME, max_num_seqs=32, num_pages=900)  # tight: pages run out too
    start(loop, order, in_flight=24)
    loop.run(600, count=False)
    loop.run(1500)
    assert_shares(loop.shares(loop.tokens))


# A machine whose step takes 10 ms plus 2 ms per decode and 0.5 ms per prefill token.
COSTS = StepCosts(fixed_s=0.010, per_decode_s=0.002, per_prefill_token_s=0.0005)


@pytest.mark.parametrize("order", ORDERS)
def test_within_the_slots_a_step_time_target_forms_the_queue_where_weights_act(
    order: tuple[str, ...],
) -> None:
    # 3 x 10 requests fit the 32 slots; without a target each tenant gets a third.
    untargeted = ClosedLoop(WEIGHTS, SAME, max_num_seqs=32)
    start(untargeted, order, in_flight=10)
    untargeted.run(1200)
    assert_shares(
        {t: s * WEIGHTS[t] * 3 / 7 for t, s in untargeted.shares(untargeted.tokens).items()}
    )
    # A 50 ms target holds 15 decodes: the other requests queue, and fair share picks (each
    # tenant has more in flight than its weighted share of 15, so each stays backlogged).
    target = StepTarget(0.050, COSTS)
    loop = ClosedLoop(WEIGHTS, SAME, max_num_seqs=32, target=target)
    start(loop, order, in_flight=10)
    loop.run(600, count=False)
    loop.run(2000)
    assert loop.max_running <= target.max_decodes == 15
    assert_shares(loop.shares(loop.tokens))


def test_within_a_target_several_tenants_prompts_go_in_short_steps_one_alone_in_one() -> None:
    target = StepTarget(0.050, COSTS)  # 80 prefill tokens fit beside no decode
    alone = ClosedLoop(WEIGHTS, {"w1": Shape(0, 300, 4)}, max_num_seqs=8, target=target)
    alone.start("w1", 1)
    assert alone.scheduler.schedule().num_batched_tokens == 300  # nobody waits on its step
    shared = ClosedLoop(WEIGHTS, {t: Shape(0, 300, 4) for t in WEIGHTS}, max_num_seqs=8)
    shared.scheduler.target = target
    for tenant in WEIGHTS:
        shared.start(tenant, 1)
    assert shared.scheduler.schedule().num_batched_tokens == target.prefill_budget(0) == 80


LIGHT = {"t1": 1.0, "t2": 1.0, "t3": 1.0}
# A 2-core CPU's measured costs (12 ms a step, 0.75 ms a decode, 0.55 ms a prompt token).
CPU = StepCosts(fixed_s=0.012, per_decode_s=0.00075, per_prefill_token_s=0.00055)


def light_first_tokens(flooder: bool, as_served: bool) -> dict[str, list[float]]:
    """Three light tenants with 2 requests in flight (and a flooder with 20), all arriving at
    once, 1,200 steps; each light tenant's times to first token."""
    weights = {**LIGHT, "flood": 1.0}
    shapes = {t: Shape(0, 120, 48) for t in weights}
    loop = ClosedLoop(weights, shapes, max_num_seqs=64, target=StepTarget(0.060, CPU))
    if not as_served:  # the counters alone: no tenants level, no decodes yielding
        loop.scheduler.policy = FairSharePolicy(level_band=0.0, decode_lead=None)
        loop.scheduler.policy.bind_running(loop.scheduler.slots, 64)
    for tenant in LIGHT:
        loop.start(tenant, 2)
    if flooder:
        loop.start("flood", 20)
    loop.run(1200)
    assert flooder == (loop.tokens["flood"] > 0)
    return {t: loop.first_token_s[t] for t in LIGHT}


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


@pytest.mark.parametrize("as_served", [True, False])
def test_a_flooder_barely_moves_the_light_tenants_first_tokens(as_served: bool) -> None:
    calm = light_first_tokens(flooder=False, as_served=as_served)
    flood = light_first_tokens(flooder=True, as_served=as_served)
    worst = {t: max(flood[t]) / max(calm[t]) for t in LIGHT}
    typical = {t: median(flood[t]) / median(calm[t]) for t in LIGHT}
    if as_served:  # level tenants go fewest requests first, and the flood's decodes yield
        assert all(r <= 1.15 for r in worst.values()), worst
        assert all(r <= 1.15 for r in typical.values()), typical
    else:  # the flood shares the first prefill evenly and its decodes lengthen every step
        assert max(worst.values()) > 1.2, worst
        assert max(typical.values()) > 1.4, typical
