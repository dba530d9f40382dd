"""The admission gate: capacity, tenants in turn when full, cancellation loses no slot."""

from __future__ import annotations

import asyncio

import pytest

from web.app import admission_concurrency
from web.tenancy.fair_gate import FairGate


async def _hold(gate: FairGate, tenant: str, order: list[str], release: asyncio.Event) -> None:
    async with gate.hold(tenant):
        order.append(tenant)
        await asyncio.sleep(0)  # a transaction's round trip: others arrive meanwhile
        await release.wait()


def test_a_burst_of_one_tenant_does_not_keep_the_others_waiting_behind_it() -> None:
    async def scenario() -> list[str]:
        gate = FairGate(1)
        order: list[str] = []
        release = asyncio.Event()
        release.set()  # each holder leaves at once
        # The flooder's forty arrive first, then one request from each of three other tenants.
        tasks = [asyncio.create_task(_hold(gate, "flood", order, release)) for _ in range(40)]
        tasks += [asyncio.create_task(_hold(gate, t, order, release)) for t in ("a", "b", "c")]
        await asyncio.gather(*tasks)
        assert gate.num_held == 0 and gate.num_waiting == 0
        return order

    order = asyncio.run(scenario())
    assert len(order) == 43
    # In turn: every other tenant is let in within the first few grants, not after the forty.
    assert max(order.index(t) for t in ("a", "b", "c")) <= 4
    assert order.count("flood") == 40


def test_capacity_bounds_the_holders_and_waiters_take_tenants_in_rotation() -> None:
    async def scenario() -> tuple[list[str], int]:
        gate = FairGate(2)
        order: list[str] = []
        release = asyncio.Event()
        holders = [asyncio.create_task(_hold(gate, "x", order, release)) for _ in range(2)]
        await asyncio.sleep(0)
        assert gate.num_held == 2
        waiters = [asyncio.create_task(_hold(gate, t, order, release)) for t in "xxxyyz"]
        await asyncio.sleep(0)
        assert gate.num_held == 2 and gate.num_waiting == 6
        peak = gate.num_held
        release.set()
        await asyncio.gather(*holders, *waiters)
        return order, peak

    order, peak = asyncio.run(scenario())
    assert peak == 2
    # After the two first holders: x, y, z in turn, then what is left, still in turn.
    assert order == ["x", "x", "x", "y", "z", "x", "y", "x"]


def test_a_cancelled_waiter_leaves_and_a_cancelled_grant_is_passed_on() -> None:
    async def scenario() -> list[str]:
        gate = FairGate(1)
        order: list[str] = []
        release = asyncio.Event()
        release.set()
        async with gate.hold("a"):
            gone = asyncio.create_task(_hold(gate, "b", order, release))
            granted_then_cancelled = asyncio.create_task(_hold(gate, "c", order, release))
            last = asyncio.create_task(_hold(gate, "d", order, release))
            await asyncio.sleep(0)
            gone.cancel()  # its client went away while it waited
            await asyncio.sleep(0)
            assert gate.num_waiting == 2
        # Leaving handed the slot to "c", which is cancelled before it could run: "d" gets it.
        granted_then_cancelled.cancel()
        await asyncio.gather(gone, granted_then_cancelled, last, return_exceptions=True)
        assert gone.cancelled() and granted_then_cancelled.cancelled()
        assert gate.num_held == 0 and gate.num_waiting == 0
        return order

    assert asyncio.run(scenario()) == ["d"]


def test_capacity_must_be_positive_and_follows_the_database() -> None:
    with pytest.raises(ValueError, match="capacity"):
        FairGate(0)
    assert admission_concurrency("sqlite+aiosqlite:///./atrium.db") == 1
    assert admission_concurrency("postgresql+asyncpg://localhost/test") > 1


def test_waiting_tenants_get_grants_by_weight_and_a_newcomer_banks_nothing() -> None:
    async def scenario() -> list[str]:
        gate = FairGate(1)
        order: list[str] = []
        release = asyncio.Event()

        async def hold(tenant: str, weight: float) -> None:
            async with gate.hold(tenant, weight):
                order.append(tenant)
                await release.wait()

        first = asyncio.create_task(hold("x", 1.0))
        await asyncio.sleep(0)
        tasks = [asyncio.create_task(hold("heavy", 3.0)) for _ in range(12)]
        tasks += [asyncio.create_task(hold("light", 1.0)) for _ in range(12)]
        await asyncio.sleep(0)
        release.set()
        await asyncio.gather(first, *tasks)
        return order[1:]

    order = asyncio.run(scenario())
    # While both wait, three grants of the weight-3 tenant for each of the weight-1 tenant.
    assert order[:8] == ["heavy", "light", "heavy", "heavy", "heavy", "light", "heavy", "heavy"]
    assert order[:16].count("heavy") == 12
