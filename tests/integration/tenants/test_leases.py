"""Gateway leases: a dead gateway's slots and reservations are settled once its lease expires,
with exactly one usage event per request; a live (renewed) lease keeps what it holds."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest
from sqlalchemy import func, select

from tenants import TenantDomain
from tenants.errors import QuotaExceededError
from tenants.models import RateBucket, Reservation, TokenBudget, UsageEventRow
from tenants.records import UsageEvent
from tenants.schemas import AuthContext, Quotas, TenantCreate, Usage
from tests.integration.tenants.conftest import FakeClock, OpenDomain

LEASE_S = 10.0


async def _tenant(domain: TenantDomain) -> AuthContext:
    quotas = Quotas(max_concurrent_requests=1, monthly_token_budget=1000)
    tenant = await domain.tenants.create(TenantCreate(name="acme", quotas=quotas))
    _, secret = await domain.keys.create_key(tenant.id)
    return await domain.keys.authenticate(secret)


async def _books(domain: TenantDomain) -> tuple[int, int, int, int, list[tuple[str, str, int]]]:
    """(reservations, in_flight, budget used, budget reserved, events)."""
    async with domain.db.sessions() as session:
        held = await session.scalar(select(func.count()).select_from(Reservation))
        in_flight = await session.scalar(select(func.sum(RateBucket.in_flight)))
        used, reserved = (
            await session.execute(
                select(func.sum(TokenBudget.used), func.sum(TokenBudget.reserved))
            )
        ).one()
        events = await session.execute(
            select(UsageEventRow.request_id, UsageEventRow.status, UsageEventRow.prompt_tokens)
        )
        rows = [(r[0], r[1], int(r[2])) for r in events]
    return int(held or 0), int(in_flight or 0), int(used or 0), int(reserved or 0), rows


def test_an_expired_lease_is_reclaimed_with_one_gateway_lost_event(
    open_domain: OpenDomain, clock: FakeClock
) -> None:
    async def body() -> None:
        async with open_domain() as domain:
            ctx = await _tenant(domain)
            dead = await domain.leases.acquire(LEASE_S)
            await domain.admission.admit(ctx, "r1", 30, 100, model="m", lease_id=dead)
            with pytest.raises(QuotaExceededError):  # the slot is held
                await domain.admission.admit(ctx, "r2", 30, 100, model="m")

            clock.advance(LEASE_S - 1)  # not expired yet: nothing is taken
            assert await domain.leases.reclaim() == 0
            assert (await _books(domain))[:2] == (1, 1)

            clock.advance(2)
            assert await domain.leases.reclaim() == 1
            assert await domain.leases.reclaim() == 0  # idempotent
            assert await _books(domain) == (0, 0, 30, 0, [("r1", "gateway_lost", 30)])
            await domain.admission.admit(ctx, "r2", 30, 100, model="m")  # served again

    asyncio.run(body())


def test_a_renewed_lease_keeps_its_reservations(open_domain: OpenDomain, clock: FakeClock) -> None:
    async def body() -> None:
        async with open_domain() as domain:
            ctx = await _tenant(domain)
            live = await domain.leases.acquire(LEASE_S)
            granted = await domain.admission.admit(ctx, "r1", 30, 100, model="m", lease_id=live)
            for _ in range(5):
                clock.advance(LEASE_S / 2)
                assert await domain.leases.renew(live, LEASE_S)
                assert await domain.leases.reclaim() == 0
            event = UsageEvent(
                request_id="r1",
                tenant_id=ctx.tenant_id,
                key_id=ctx.key_id,
                model="m",
                prompt_tokens=30,
                cached_tokens=0,
                completion_tokens=7,
                status="ok",
                started_at=clock.now,
                finished_at=clock.now,
            )
            usage = Usage(prompt_tokens=30, completion_tokens=7)
            assert await domain.admission.settle(granted, usage, event)
            assert await _books(domain) == (0, 0, 37, 0, [("r1", "ok", 30)])

    asyncio.run(body())


def test_a_stored_event_is_charged_not_duplicated_and_a_late_settle_is_a_no_op(
    open_domain: OpenDomain, clock: FakeClock
) -> None:
    async def body() -> None:
        async with open_domain() as domain:
            ctx = await _tenant(domain)
            dead = await domain.leases.acquire(LEASE_S)
            granted = await domain.admission.admit(ctx, "r1", 30, 100, model="m", lease_id=dead)
            event = UsageEvent(
                request_id="r1",
                tenant_id=ctx.tenant_id,
                key_id=ctx.key_id,
                model="m",
                prompt_tokens=30,
                cached_tokens=0,
                completion_tokens=12,
                status="ok",
                started_at=clock.now,
                finished_at=clock.now,
            )
            await domain.meter.start()
            domain.meter.record(event)  # stored through the meter, the settle never came
            await domain.meter.flush()
            clock.advance(LEASE_S + 1)
            assert await domain.leases.reclaim() == 1
            assert await _books(domain) == (0, 0, 42, 0, [("r1", "ok", 30)])
            late = Usage(prompt_tokens=30, completion_tokens=12)
            assert not await domain.admission.settle(granted, late, event)
            assert await _books(domain) == (0, 0, 42, 0, [("r1", "ok", 30)])

    asyncio.run(body())


def test_a_released_lease_is_reclaimable_at_once_and_unowned_rows_only_when_old(
    open_domain: OpenDomain, clock: FakeClock
) -> None:
    async def body() -> None:
        async with open_domain() as domain:
            ctx = await _tenant(domain)
            await domain.admission.admit(ctx, "legacy", 5, 5)  # no lease: made by an old gateway
            assert await domain.leases.reclaim() == 0
            clock.advance(timedelta(hours=1, seconds=1).total_seconds())
            assert await domain.leases.reclaim() == 1
            stopped = await domain.leases.acquire(LEASE_S)
            await domain.admission.admit(ctx, "r1", 5, 5, model="m", lease_id=stopped)
            await domain.leases.release(stopped)
            assert await domain.leases.reclaim() == 1
            statuses = sorted((rid, status) for rid, status, _ in (await _books(domain))[4])
            assert statuses == [("legacy", "gateway_lost"), ("r1", "gateway_lost")]

    asyncio.run(body())


def test_a_dead_gateways_checkpointed_output_is_billed_with_its_prompt(
    open_domain: OpenDomain, clock: FakeClock
) -> None:
    async def body() -> None:
        async with open_domain() as domain:
            tenant = await domain.tenants.create(
                TenantCreate(name="acme", quotas=Quotas(monthly_token_budget=1000))
            )
            _, secret = await domain.keys.create_key(tenant.id)
            ctx = await domain.keys.authenticate(secret)
            dead = await domain.leases.acquire(LEASE_S)
            await domain.admission.admit(ctx, "r1", 30, 100, model="m", lease_id=dead)
            done = await domain.admission.admit(ctx, "r2", 20, 100, model="m", lease_id=dead)
            await domain.admission.checkpoint({"r1": 25})
            # Checkpoints never move back; one written with a settlement (same group) or after
            # it (the row is gone) changes nothing of the settled request.
            await asyncio.gather(
                domain.admission.checkpoint({"r1": 40, "r2": 9}),
                domain.admission.settle(done, Usage(prompt_tokens=20, completion_tokens=5)),
                domain.admission.checkpoint({"r1": 10}),
            )
            await domain.admission.checkpoint({"r2": 50})
            async with domain.db.sessions() as session:
                assert await session.scalar(select(Reservation.completion_tokens)) == 40

            clock.advance(LEASE_S + 1)
            assert await domain.leases.reclaim() == 1
            async with domain.db.sessions() as session:
                event = await session.get(UsageEventRow, "r1")
            assert event is not None
            assert (event.status, event.prompt_tokens, event.completion_tokens) == (
                "gateway_lost",
                30,
                40,
            )
            # 30 + 40 for the lost request, 25 for the settled one; nothing left reserved.
            assert (await _books(domain))[:4] == (0, 0, 95, 0)

    asyncio.run(body())
