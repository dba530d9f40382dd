"""Weighted VTC admission: shares by weight, no banked idleness, deadline aging, locality inside
a tenant."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.fair_share import FairSharePolicy
from engine.request import Request, owner_tag
from engine.sampling_params import SamplingParams

_ids = itertools.count()


def make_request(
    tenant: str, weight: float = 1.0, prompt_len: int = 8, deadline_s: float = float("inf")
) -> Request:
    rid = f"r{next(_ids)}"
    return Request(
        request_id=rid,
        prompt_token_ids=list(range(prompt_len)),
        params=SamplingParams(max_tokens=4),
        tenant_id=tenant,
        namespace=f"tenant:{tenant}",
        owner=owner_tag(rid),
        arrival_index=next(_ids),
        tenant_weight=weight,
        deadline_s=deadline_s,
    )


def serve(policy: FairSharePolicy, steps: int, cost: int) -> dict[str, int]:
    """Admit one request per step and charge it ``cost`` output tokens; count tokens per tenant."""
    served: dict[str, int] = {}
    for _ in range(steps):
        request = policy.pop()
        policy.charge(request, 0, 0, cost)
        served[request.tenant_id] = served.get(request.tenant_id, 0) + cost
    return served


def test_equal_weights_share_equally_despite_ten_times_the_requests() -> None:
    policy = FairSharePolicy()
    for _ in range(400):
        policy.add(make_request("flood"))
    for _ in range(40):
        policy.add(make_request("quiet"))
    served = serve(policy, steps=60, cost=5)
    share = served["quiet"] / (served["quiet"] + served["flood"])
    assert 0.45 <= share <= 0.55


def test_weights_two_to_one_give_two_thirds() -> None:
    policy = FairSharePolicy()  # the counters alone, at this small scale
    for _ in range(200):
        policy.add(make_request("heavy", weight=2.0))
        policy.add(make_request("light", weight=1.0))
    served = serve(policy, steps=90, cost=3)
    share = served["heavy"] / (served["heavy"] + served["light"])
    assert abs(share - 2 / 3) <= 0.05


def test_returning_tenant_gets_no_burst_for_its_idle_time() -> None:
    policy = FairSharePolicy()
    for _ in range(100):
        policy.add(make_request("busy"))
    serve(policy, steps=50, cost=10)  # busy's counter is now high, idle's is 0
    for _ in range(50):
        policy.add(make_request("idle"))
    served = serve(policy, steps=20, cost=10)
    # Lifted to the backlogged minimum: the newcomer alternates instead of taking all 20 turns.
    assert served["idle"] <= 11 * 10
    assert served.get("busy", 0) >= 9 * 10


def test_a_returning_tenant_wins_the_tie_once_then_alternates() -> None:
    policy = FairSharePolicy()
    for _ in range(10):
        policy.add(make_request("busy"))
    serve(policy, steps=3, cost=10)
    policy.add(make_request("back"))
    policy.add(make_request("back"))
    assert policy.counter("back") == policy.counter("busy")  # lifted, no credit
    # Ahead of the older requests of the tenant at the same counter, but only until served.
    first = policy.pop()
    assert first.tenant_id == "back"
    policy.charge(first, 0, 0, 1)
    after = policy.peek()
    assert after is not None and after.tenant_id == "busy"


def test_the_counter_decides_whatever_slots_the_tenants_hold() -> None:
    policy = FairSharePolicy()
    slots: dict[str, int] = {}
    policy.bind_running(slots, max_num_seqs=8)
    for _ in range(5):
        policy.add(make_request("flood"))
    policy.add(make_request("quiet"))
    policy.charge(make_request("quiet"), 0, 0, 50)  # quiet's counter is now far above flood's
    slots["flood"] = 6  # more than half of the slots: still the less-served tenant goes first
    assert policy.pop().tenant_id == "flood"
    policy.charge(make_request("flood"), 0, 0, 60)  # now flood has been served more
    assert policy.pop().tenant_id == "quiet"


def test_a_victim_for_another_tenant_comes_from_a_tenant_ahead_of_it() -> None:
    policy = FairSharePolicy(preempt_lead=100.0)
    waiting = make_request("quiet")
    policy.add(waiting)
    near, far = make_request("near"), make_request("far")
    policy.charge(near, 0, 0, 40)  # 80 ahead of quiet's 0
    policy.charge(far, 0, 0, 60)  # 120 ahead
    slots = {"quiet": 1, "near": 1, "far": 1}
    policy.bind_running(slots, max_num_seqs=3)
    assert policy.pick_victim([near, far], beneficiary=waiting) is far
    assert policy.pick_victim([near], beneficiary=waiting) is None
    assert policy.pick_victim([near]) is near  # for pages, any running request may go
    slots["quiet"] = 0  # a tenant that runs nothing is not kept waiting by any tenant ahead
    assert policy.pick_victim([near], beneficiary=waiting) is near
    policy.charge(waiting, 0, 0, 50)  # but never by taking from a tenant served less
    assert policy.pick_victim([near], beneficiary=waiting) is None


def test_a_tenant_arriving_at_an_idle_engine_gets_no_credit_for_what_others_were_served() -> None:
    policy = FairSharePolicy()
    slots: dict[str, int] = {}
    policy.bind_running(slots, max_num_seqs=8)
    for _ in range(10):
        policy.add(make_request("old"))
    serve(policy, steps=10, cost=10)  # old is charged 200, then the engine goes idle
    assert len(policy) == 0
    policy.add(make_request("new"))  # nobody waits or runs: lifted to the largest counter
    assert policy.counter("new") == policy.counter("old") == 200
    for _ in range(9):
        policy.add(make_request("new"))
    for _ in range(10):
        policy.add(make_request("old"))
    served = serve(policy, steps=10, cost=10)
    assert served == {"new": 50, "old": 50}  # they alternate from the first turn


def test_a_tenant_returning_while_another_only_runs_is_lifted_to_the_running_one() -> None:
    policy = FairSharePolicy()
    slots: dict[str, int] = {}
    policy.bind_running(slots, max_num_seqs=8)
    busy = make_request("busy")
    policy.add(busy)
    policy.pop()
    slots["busy"] = 1  # running, nothing waiting
    policy.charge(busy, 300, 0, 20)
    back = make_request("back")
    policy.add(back)
    assert policy.counter("back") == policy.counter("busy") == 340
    policy.charge(back, 100, 0, 0)
    policy.add(make_request("back"))
    # busy never went idle: its next request keeps its counter (it is not lifted to back's).
    policy.add(make_request("busy"))
    assert policy.counter("busy") == 340
    assert policy.pop().tenant_id == "busy"


def horizon(num_tokens: int) -> float:
    """A prompt needs 1 ms a token to its first token."""
    return num_tokens / 1000


def test_a_request_at_risk_goes_ahead_of_the_counters_and_a_late_one_does_not() -> None:
    policy = FairSharePolicy()
    for _ in range(5):
        policy.add(make_request("light", deadline_s=10.0))
    served = make_request("heavy", deadline_s=1.0)
    policy.add(served)
    policy.charge(served, 0, 0, 500)  # heavy is far ahead: by the counters it goes last
    policy.begin_step(0.5, horizon)  # 0.5 s before its deadline, its 8 tokens need 8 ms
    assert policy.pop().tenant_id == "light"
    policy.begin_step(0.995, horizon)  # now it must start: it goes ahead of the counters
    assert policy.is_due(served)
    assert policy.pop() is served
    late = make_request("heavy", deadline_s=1.0)
    policy.add(late)
    policy.begin_step(2.0, horizon)  # past its deadline: no longer ahead of anyone
    assert policy.is_due(late)  # (it may still take a slot beyond the decode limit)
    assert policy.pop().tenant_id == "light"


def test_among_tenants_at_risk_the_counters_decide() -> None:
    policy = FairSharePolicy()
    a, b = make_request("a", deadline_s=1.0), make_request("b", deadline_s=1.0)
    policy.add(a)
    policy.add(b)
    policy.charge(a, 0, 0, 50)
    policy.begin_step(0.999, horizon)
    assert policy.pop() is b


def test_within_a_tenant_a_due_request_goes_before_a_longer_cached_prefix() -> None:
    lengths = {}
    policy = FairSharePolicy(prefix_len=lambda r: lengths[r.request_id])
    cached = make_request("a", deadline_s=5.0)
    old = make_request("a", deadline_s=1.0)
    lengths.update({cached.request_id: 64, old.request_id: 0})
    policy.add(old)
    policy.add(cached)
    policy.begin_step(0.0, horizon)
    assert policy.peek() is cached  # nothing due: locality first
    policy.begin_step(0.995, horizon)
    assert policy.pop() is old


def test_longest_cached_prefix_first_within_a_tenant() -> None:
    lengths = {}
    policy = FairSharePolicy(prefix_len=lambda r: lengths[r.request_id])
    short, long_, mid = make_request("a"), make_request("a"), make_request("a")
    lengths.update({short.request_id: 0, long_.request_id: 64, mid.request_id: 16})
    for request in (short, long_, mid):
        policy.add(request)
    assert [policy.pop() for _ in range(3)] == [long_, mid, short]


def test_preempted_request_goes_first_and_victim_is_the_most_served_tenant() -> None:
    policy = FairSharePolicy()
    waiting = make_request("a")
    policy.add(waiting)
    preempted = make_request("a")
    policy.requeue_front(preempted)
    assert policy.pop() is preempted
    rich, poor = make_request("rich"), make_request("poor")
    rich.admitted_index, poor.admitted_index = 1, 2
    policy.charge(rich, 100, 0, 0)
    assert policy.pick_victim([poor, rich]) is rich


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abc"), st.sampled_from(["add", "pop", "remove"]))))
def test_no_request_is_lost_or_duplicated(ops: list[tuple[str, str]]) -> None:
    policy = FairSharePolicy()
    queued: list[Request] = []
    popped: list[Request] = []
    for tenant, op in ops:
        if op == "add":
            request = make_request(tenant)
            policy.add(request)
            queued.append(request)
        elif op == "pop" and queued:
            request = policy.pop()
            assert request in queued
            queued.remove(request)
            popped.append(request)
        elif op == "remove" and queued:
            victim = next((r for r in queued if r.tenant_id == tenant), None)
            if victim is not None:
                assert policy.remove(victim)
                assert not policy.remove(victim)
                queued.remove(victim)
        assert len(policy) == len(queued)
        assert sorted(r.request_id for r in policy.waiting()) == sorted(
            r.request_id for r in queued
        )
        assert sum(policy.num_waiting_by_tenant().values()) == len(queued)
