"""Weighted VTC admission: shares by weight, no banked idleness, locality inside a tenant."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.fair_share import FairSharePolicy
from engine.request import Request, owner_tag
from engine.sampling_params import SamplingParams

_ids = itertools.count()


def make_request(
    tenant: str, weight: float = 1.0, prompt_len: int = 8, tenant_requests: int = 0
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
        tenant_requests=tenant_requests,
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
    policy = FairSharePolicy(level_band=0.0)  # the counters alone, at this small scale
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
    policy = FairSharePolicy(level_band=0.0)
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


def test_a_flood_back_from_idle_goes_behind_a_smaller_queue_at_its_counter() -> None:
    policy = FairSharePolicy()
    slots: dict[str, int] = {}
    policy.bind_running(slots, max_num_seqs=64)
    light = make_request("light")
    policy.add(light)
    policy.pop()
    slots["light"] = 1  # running
    policy.charge(light, 96, 0, 0)
    policy.add(make_request("light"))  # its second prompt waits
    for _ in range(20):
        policy.add(make_request("flood"))  # back from idle: lifted to light's counter
    assert policy.counter("flood") == policy.counter("light")
    policy.begin_step()
    # The flood's return wins ties among queues of its size, not against a burst of two.
    assert policy.pop().tenant_id == "light"
    assert policy.pop().tenant_id == "flood"


def test_the_counter_decides_whatever_slots_the_tenants_hold() -> None:
    policy = FairSharePolicy(level_band=0.0)
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


def test_level_tenants_go_fewest_requests_first_and_the_band_bounds_it() -> None:
    policy = FairSharePolicy(level_band=100.0)
    slots: dict[str, int] = {}
    policy.bind_running(slots, max_num_seqs=64)
    for _ in range(20):
        policy.add(make_request("flood"))
    for _ in range(2):
        policy.add(make_request("light"))
    order = []
    for _ in range(6):
        policy.begin_step()
        request = policy.pop()
        slots[request.tenant_id] = slots.get(request.tenant_id, 0) + 1
        policy.charge(request, 30, 0, 0)
        order.append(request.tenant_id)
    # Light's two prompts go first although its counter passed flood's after the first (30 is
    # within the band of 100); then flood, which has nothing left to compete with.
    assert order == ["light", "light", "flood", "flood", "flood", "flood"]
    for _ in range(3):
        policy.add(make_request("light"))
    policy.begin_step()  # light 60 and flood 120: level, and light has fewer requests
    head = policy.peek()
    assert head is not None and head.tenant_id == "light"
    policy.charge(make_request("light"), 0, 0, 100)  # light at 260, beyond flood's 120 + 100
    policy.begin_step()
    assert policy.pop().tenant_id == "flood"
    # Beyond the band the counter alone decides, whatever the queues hold.
    assert policy.service_key(make_request("light"))[0] == 260.0
    assert policy.service_key(make_request("flood"))[0] == 120.0


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


def test_prefill_caps_hold_tenants_ahead_of_the_least_served_to_their_weighted_share() -> None:
    policy = FairSharePolicy()
    slots: dict[str, int] = {}
    policy.bind_running(slots, max_num_seqs=8)
    lead = make_request("lead", weight=2.0)
    policy.add(lead)
    assert policy.prefill_caps(2048) is None  # one active tenant: nothing to protect
    for tenant in ("mid", "low"):
        policy.add(make_request(tenant))
    assert policy.prefill_caps(2048) == {}  # level counters: nobody is ahead
    policy.charge(lead, 100, 0, 0)
    policy.charge(make_request("mid"), 10, 0, 0)
    # Weights 2 : 1 : 1 of 2048; the least served ("low") is not capped.
    assert policy.prefill_caps(2048) == {"lead": 1024, "mid": 512}
    for i in range(20):
        policy.add(make_request(f"other{i}"))
        policy.charge(make_request(f"other{i}"), 500, 0, 0)
    caps = policy.prefill_caps(2048)
    assert caps is not None and caps["mid"] == 2048 // 8  # never below an eighth
    assert "low" not in caps


def test_prefill_caps_count_running_tenants_as_active() -> None:
    policy = FairSharePolicy()
    slots: dict[str, int] = {}
    policy.bind_running(slots, max_num_seqs=8)
    flood = make_request("flood")
    policy.add(flood)
    policy.charge(flood, 1000, 0, 0)
    slots["quiet"] = 1  # only decoding: nothing waiting, but active
    quiet = make_request("quiet")
    policy.charge(quiet, 50, 0, 0)
    assert policy.prefill_caps(1000) == {"flood": 500}


def test_among_level_tenants_the_smaller_queue_goes_first_and_the_flood_keeps_its_turns() -> None:
    policy = FairSharePolicy()
    for _ in range(40):
        policy.add(make_request("flood"))  # arrived first
    for tenant in ("a", "b"):
        for _ in range(4):
            policy.add(make_request(tenant))
    order = []
    for _ in range(9):
        request = policy.pop()
        policy.charge(request, 256, 0, 0)
        order.append(request.tenant_id)
    # Each round serves every tenant once; the small queues first, the flood last.
    assert order == ["a", "b", "flood"] * 3


def test_a_flood_still_crossing_the_gateway_ranks_by_the_gateways_count() -> None:
    """Two of a flood's twenty requests have reached the engine, beside two light tenants' two
    each: by the engine's own count the flood is one of them; by the gateway's it is twenty."""

    def first_served(flood_at_gateway: int) -> list[str]:
        policy = FairSharePolicy()
        for _ in range(2):
            policy.add(make_request("flood", tenant_requests=flood_at_gateway))
            policy.add(make_request("a", tenant_requests=2))
            policy.add(make_request("b", tenant_requests=2))
        order = []
        for _ in range(6):
            request = policy.pop()
            policy.charge(request, 32, 0, 0)
            order.append(request.tenant_id)
        return order

    assert sorted(first_served(flood_at_gateway=20)[:4]) == ["a", "a", "b", "b"]
    assert "flood" in first_served(flood_at_gateway=0)[:3]  # without the count it goes first


def test_the_gateways_count_is_dropped_once_the_tenant_has_nothing_waiting() -> None:
    policy = FairSharePolicy()
    policy.add(make_request("flood", tenant_requests=20))
    policy.pop()
    # Its next request says nothing of the gateway: the old count does not linger.
    policy.add(make_request("flood"))
    policy.add(make_request("a", tenant_requests=2))
    policy.add(make_request("a", tenant_requests=2))
    assert policy.peek() is not None and policy.peek().tenant_id == "flood"  # type: ignore[union-attr]


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
