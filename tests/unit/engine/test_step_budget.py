"""The step budget and the preemption choices on their own, without a scheduler around them."""

from __future__ import annotations

import pytest

from engine.fair_share import FairSharePolicy
from engine.policy import FifoPolicy
from engine.preemption import page_victim, slot_victim
from engine.request import Request, RequestStatus, owner_tag
from engine.sampling_params import SamplingParams
from engine.step_budget import MAX_STRETCH, PLAN_STRETCH, StepBudget
from engine.step_target import StepCosts, StepTarget
from radix_cache.prefix_cache import tenant_namespace

COSTS = StepCosts(0.002, 0.001, 0.0001)  # 2 ms a step, 1 ms a decode, 0.1 ms a prompt token


def _request(request_id: str, tenant: str, num_prompt: int = 4, weight: float = 1.0) -> Request:
    request = Request(
        request_id=request_id,
        prompt_token_ids=list(range(num_prompt)),
        params=SamplingParams(max_tokens=8, temperature=0.0),
        tenant_id=tenant,
        namespace=tenant_namespace(tenant),
        owner=owner_tag(request_id),
        arrival_index=0,
    )
    request.tenant_weight = weight
    return request


def _decoding(request: Request, index: int) -> Request:
    """``request`` as if admitted ``index``-th with its prompt computed and a token out."""
    request.status = RequestStatus.RUNNING
    request.admitted_index = index
    request.append_token(1)
    request.num_computed_tokens = request.num_tokens - 1
    return request


def _served(policy: FairSharePolicy, tenant: str, num_output: int) -> None:
    policy.charge(_request(f"{tenant}-charge", tenant), 0, 0, num_output)


def test_the_stretch_is_the_square_of_the_oldest_overdue_wait_up_to_a_bound() -> None:
    now = [0.0]
    target = StepTarget(0.020, COSTS)
    budget = StepBudget(target, 1.0, clock=lambda: now[0])
    first, second = _request("a", "t"), _request("b", "t")
    budget.watch(first, 0.0)
    budget.watch(second, 0.5)
    for at, stretch in ((0.5, 1.0), (3.0, 9.0), (100.0, MAX_STRETCH)):
        now[0] = at
        budget.begin_step()
        assert target.stretch == pytest.approx(stretch)
    first.append_token(1)  # its first token came: the next oldest wait counts
    now[0] = 2.5
    budget.begin_step()
    assert target.stretch == pytest.approx(4.0)


def test_the_stretch_a_prompt_needs_by_its_deadline() -> None:
    target = StepTarget(0.020, COSTS)  # beside 10 decodes: 8 ms of a 20 ms step for prompts
    # 100 tokens in a second need 1% of the time: the unstretched steps give them 40%.
    assert target.stretch_to_prefill(100, 1.0, 10) == 1.0
    # 800 tokens in 0.2 s (0.18 s once the last step is counted whole) need 44% of the time:
    # steps of 12 ms / (1 - 0.444) = 21.6 ms.
    assert target.stretch_to_prefill(800, 0.2, 10) == pytest.approx(0.012 / (1 - 4 / 9) / 0.02)
    # 1,000 tokens need 56% of the time: steps of 12 ms / (1 - 0.556) = 27 ms.
    assert target.stretch_to_prefill(1000, 0.2, 10) == pytest.approx(0.012 / (1 - 5 / 9) / 0.02)
    # 1,800 tokens would need all of it: no stretch brings them.
    assert target.stretch_to_prefill(1800, 0.2, 10) == float("inf")
    assert target.stretch_to_prefill(10, 0.01, 10) == float("inf")  # due within this step
    # A machine twice as slow as measured: 400 tokens need 44% of the time, beside decodes
    # that take 22 ms.
    target.scale = target.prefill_scale = 2.0
    assert target.stretch_to_prefill(400, 0.2, 10) == pytest.approx(0.022 / (1 - 4 / 9) / 0.02)
    target.scale = 1.0  # only the prompts slower than measured: the same share, 12 ms of decodes
    assert target.stretch_to_prefill(400, 0.2, 10) == pytest.approx(0.012 / (1 - 4 / 9) / 0.02)


def test_first_tokens_that_can_still_come_in_time_stretch_the_target_in_arrival_order() -> None:
    now = [0.0]
    target = StepTarget(0.020, COSTS)
    budget = StepBudget(target, 1.0, clock=lambda: now[0])
    first, second = _request("a", "t", num_prompt=1000), _request("b", "t", num_prompt=3000)
    first.cached_on_arrival = 400  # 600 tokens to compute
    budget.watch(first, 0.0)
    budget.watch(second, 0.0)
    now[0] = 0.8
    budget.begin_step(10)
    # The first alone needs 600 tokens in 0.18 s: 1/3 of the time, which unstretched steps give.
    # Both (3,600 tokens) could not come in time: the longer leaves the plan.
    assert target.stretch == 1.0
    assert not first.first_token_late and second.first_token_late
    now[0] = 0.85  # 600 tokens in 0.13 s: 46% of the time
    budget.begin_step(10)
    assert target.stretch == pytest.approx(0.012 / (1 - 0.06 / 0.13) / 0.02)
    first.num_computed_tokens = 700  # admitted, 300 computed past its cached prefix
    budget.begin_step(10)
    assert target.stretch == 1.0
    now[0] = 0.95  # 300 tokens in 0.03 s: more than all of it, no stretch brings them
    budget.begin_step(10)
    assert target.stretch == 1.0
    assert first.first_token_late
    now[0] = 1.5  # both late: the square of the oldest wait over the target, as before
    budget.begin_step(10)
    assert target.stretch == pytest.approx(2.25)


def test_a_long_queue_plans_for_the_first_tokens_one_target_can_serve() -> None:
    now = [0.0]
    target = StepTarget(0.020, COSTS)
    budget = StepBudget(target, 1.0, clock=lambda: now[0])
    flood = [_request(f"r{i}", "flood", num_prompt=500) for i in range(1000)]
    for request in flood:
        budget.watch(request, 0.0)
    now[0] = 0.1
    budget.begin_step(10)
    # Steps of at most PLAN_STRETCH = 4 targets (80 ms) beside 12 ms of decodes give prompts 85%
    # of the 0.88 s left: 7,480 tokens. The first 14 requests' 7,000 are planned, and the
    # rest, which could not come in time, are late.
    assert PLAN_STRETCH == 4.0
    assert [r.first_token_late for r in flood] == [False] * 14 + [True] * 986
    # 7,000 tokens in 0.88 s need 79.5% of the time: steps of 12 ms / (1 - 0.795).
    assert target.stretch == pytest.approx(0.012 / (1 - 0.7 / 0.88) / 0.02)


def test_a_burst_too_long_for_its_deadlines_leaves_its_longest_prompt_late() -> None:
    now = [0.0]
    target = StepTarget(0.020, COSTS)
    budget = StepBudget(target, 1.0, clock=lambda: now[0])
    # 7,000, 3,000 and 3,000 tokens arrive (1.3 s of prompt work) for deadlines at 1.0, 1.1
    # and 1.2 s. In arrival order only the first comes in time; without it both others do.
    long, short, shorter = (
        _request("long", "a", num_prompt=7000),
        _request("short", "b", num_prompt=3000),
        _request("shorter", "c", num_prompt=3000),
    )
    for request, at in ((long, 0.0), (short, 0.1), (shorter, 0.2)):
        budget.watch(request, at)
    now[0] = 0.2
    budget.begin_step(0)
    assert [r.first_token_late for r in (long, short, shorter)] == [True, False, False]
    # The two planned: 6,000 tokens in 0.98 s (less the step in flight), 61% of the time,
    # which steps without decodes give unstretched.
    assert target.stretch == 1.0
    # Once past its deadline by more than the target, the long one goes first and the plan
    # counts its work ahead of the others'.
    now[0] = 2.05
    for request in (short, shorter):
        request.append_token(1)
    late = _request("new", "b", num_prompt=3000)
    budget.watch(late, 2.0)
    budget.begin_step(0)
    assert not long.first_token_late
    # 7,000 + 3,000 tokens in 0.93 s: more than all of it, so the new one is late.
    assert late.first_token_late
    assert target.stretch == pytest.approx(min(64.0, (2.05 / 1.0) ** 2))


def test_without_a_first_token_target_nothing_stretches_or_passes_the_slot_limit() -> None:
    target = StepTarget(0.020, COSTS)
    budget = StepBudget(target, None, clock=lambda: 100.0)
    budget.watch(_request("a", "t"), 0.0)
    budget.begin_step()
    assert target.stretch == 1.0
    assert budget.slot_limit(64) == target.max_decodes == 13
    policy = FairSharePolicy()
    _served(policy, "ahead", 1000)
    assert not budget.admits_past_limit(_request("b", "behind"), policy, {"ahead": 13})


def test_a_tenant_far_behind_a_running_one_passes_the_slot_limit() -> None:
    budget = StepBudget(StepTarget(0.020, COSTS), 1.0)
    policy = FairSharePolicy(decode_lead=16.0)
    _served(policy, "ahead", 10)  # 20 units ahead of a tenant that has run nothing
    assert budget.admits_past_limit(_request("b", "behind"), policy, {"ahead": 13})
    _served(policy, "behind", 4)  # now within the lead
    assert not budget.admits_past_limit(_request("c", "behind"), policy, {"ahead": 13})


def test_decodes_past_the_target_sit_out_most_served_first_down_to_the_target() -> None:
    target = StepTarget(0.020, COSTS)
    budget = StepBudget(target, 1.0)
    policy = FairSharePolicy(decode_lead=16.0)
    _served(policy, "far", 100)
    _served(policy, "near", 20)
    decodes = [_decoding(_request(f"l{i}", "least"), i) for i in range(8)]
    decodes += [_decoding(_request(f"n{i}", "near"), 8 + i) for i in range(4)]
    decodes += [_decoding(_request(f"f{i}", "far"), 12 + i) for i in range(4)]
    kept = budget.trim_decodes_ahead(decodes, [], policy)
    assert len(kept) == target.decodes_within(1.0) == 13
    # Three must sit out: the far tenant's, its latest admissions first.
    assert {r.request_id for r in decodes} - {r.request_id for r in kept} == {"f1", "f2", "f3"}
    # Admission order ranks no tenant above another: every decode runs.
    assert budget.trim_decodes_ahead(decodes, [], FifoPolicy()) == decodes


def test_decodes_ahead_sit_out_until_a_less_served_prompt_fits() -> None:
    target = StepTarget(0.020, COSTS)
    budget = StepBudget(target, None)
    policy = FairSharePolicy(decode_lead=16.0, yield_lead=None)
    _served(policy, "flood", 100)
    decodes = [_decoding(_request(f"f{i}", "flood"), i) for i in range(13)]
    prompt = _request("p", "light", num_prompt=60)
    assert target.prefill_budget(13) < 60
    kept, deferred, sitting = budget.defer_decodes_ahead(decodes, [], [prompt], policy)
    assert target.prefill_budget(len(kept)) >= 60 > target.prefill_budget(len(kept) + 1)
    assert len(kept) + len(deferred) == 13 and not sitting
    # A prompt no step could hold: nobody sits out for it.
    huge = _request("h", "light", num_prompt=5000)
    assert budget.defer_decodes_ahead(decodes, [], [huge], policy) == (decodes, [], set())


def test_prefill_keeps_its_share_beside_decodes_past_the_target() -> None:
    target = StepTarget(0.020, COSTS, min_prefill_tokens=4)
    with_ttft = StepBudget(target, 1.0)
    without = StepBudget(target, None)
    # 64 decodes leave nothing of a 20 ms step: the floor alone, or the prompts' share.
    assert without.prefill_held_back(512, 64, lambda: 2) == 512 - 4
    assert with_ttft.prefill_held_back(512, 64, lambda: 2) == 512 - target.prefill_share()
    # No decodes and one tenant: the whole budget; without a target nothing is held back.
    assert without.prefill_held_back(512, 0, lambda: 1) == 0
    assert StepBudget(None, None).prefill_held_back(512, 64, lambda: 2) == 0


def test_a_slot_goes_to_a_tenant_under_its_share_from_one_over_it() -> None:
    policy = FairSharePolicy(preempt_lead=0.0)
    running = [_decoding(_request(f"a{i}", "a"), i) for i in range(4)]
    _served(policy, "a", 50)
    head = _request("b0", "b")
    victim = slot_victim(running, {"a": 4}, head, 4, policy)
    assert victim is running[-1]  # the most recent admission of the tenant over its share
    # A tenant already at its share gets no slot by preemption.
    assert slot_victim(running[:2], {"a": 2, "b": 2}, head, 4, policy) is None


def test_a_prompt_takes_pages_only_from_later_admissions() -> None:
    policy = FifoPolicy()
    early = _decoding(_request("early", "t"), 0)
    prompt = _request("prompt", "t", num_prompt=64)
    prompt.status, prompt.admitted_index = RequestStatus.RUNNING, 1
    late = _decoding(_request("late", "t"), 2)
    running = [early, prompt, late]
    assert page_victim(running, set(), prompt, policy) is late
    assert page_victim(running, {"late"}, prompt, policy) is None  # scheduled this step
    # A decode may take from any.
    assert page_victim(running, {"late"}, late, policy) is prompt
