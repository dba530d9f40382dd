"""FIFO admission policy: order, requeue at the front, removal and per-tenant counts."""

from __future__ import annotations

import pytest

from engine.policy import FifoPolicy
from engine.request import Request, owner_tag
from engine.sampling_params import SamplingParams


def make(rid: str, tenant: str = "t") -> Request:
    return Request(rid, [1], SamplingParams(), tenant, f"tenant:{tenant}", owner_tag(rid), 0)


def test_fifo_order_with_requeue_and_remove() -> None:
    policy = FifoPolicy()
    a, b, c = make("a"), make("b", "u"), make("c")
    for r in (a, b, c):
        policy.add(r)
    assert policy.peek() is a and policy.pop() is a
    policy.requeue_front(a)
    assert policy.remove(b) and not policy.remove(b)
    assert [r.request_id for r in policy.waiting()] == ["a", "c"]
    assert policy.num_waiting_by_tenant() == {"t": 2}
    assert policy.pop() is a and policy.pop() is c and len(policy) == 0
    assert policy.peek() is None
    with pytest.raises(IndexError):
        policy.pop()


def test_fifo_passes_over_skipped_tenants_in_order() -> None:
    policy = FifoPolicy()
    a, b, c = make("a", "t"), make("b", "t"), make("c", "u")
    for r in (a, b, c):
        policy.add(r)
    assert policy.peek({"t"}) is c and policy.pop({"t"}) is c
    assert policy.peek({"t"}) is None
    with pytest.raises(IndexError):
        policy.pop({"t"})
    assert policy.pop(()) is a and policy.pop({"u"}) is b and len(policy) == 0
    assert policy.prefill_caps(2048) is None  # first come, first served: nobody is capped
