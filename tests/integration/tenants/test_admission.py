"""Admission: prompt limit, per-minute buckets, concurrency, monthly budget and settlement."""

from __future__ import annotations

import asyncio
from datetime import UTC

import pytest
from sqlalchemy import event, select

from tenants.errors import (
    BudgetExhaustedError,
    DuplicateRequestError,
    LimitUnreachableError,
    PromptTooLargeError,
    QuotaExceededError,
    TenantSuspendedError,
)
from tenants.models import RateBucket, TokenBudget, UsageEventRow
from tenants.records import UsageEvent
from tenants.schemas import Admission, Quotas, TenantCreate, TenantPatch, Usage


async def _tenant(domain, **quotas):
    tenant = await domain.tenants.create(TenantCreate(name="acme", quotas=Quotas(**quotas)))
    _, secret = await domain.keys.create_key(tenant.id)
    return await domain.keys.authenticate(secret)


def test_requests_per_minute_refill_over_time(open_domain, clock) -> None:
    async def body() -> None:
        async with open_domain() as domain:
            ctx = await _tenant(domain, requests_per_minute=3)
            admitted = [await domain.admission.admit(ctx, f"r{i}", 10, 10) for i in range(3)]
            assert [a.remaining_requests for a in admitted] == [2, 1, 0]
            with pytest.raises(QuotaExceededError) as refused:
                await domain.admission.admit(ctx, "r3", 10, 10)
            err = refused.value
            assert (err.reason, err.limit_requests, err.remaining_requests) == (
                "requests_per_minute",
                3,
                0,
            )
            assert err.retry_after_s == pytest.approx(20.0)
            clock.advance(20)  # one request's worth of refill
            await domain.admission.admit(ctx, "r3", 10, 10)
            with pytest.raises(QuotaExceededError):
                await domain.admission.admit(ctx, "r4", 10, 10)

    asyncio.run(body())


def test_tokens_per_minute_count_prompt_plus_max_tokens_and_refund_unused(open_domain) -> None:
    async def body() -> None:
        async with open_domain() as domain:
            ctx = await _tenant(domain, tokens_per_minute=1000)
            first = await domain.admission.admit(ctx, "a", 300, 300)
            assert (first.limit_tokens, first.remaining_tokens) == (1000, 400)
            assert first.reset_tokens_s == pytest.approx(36.0)  # 600 drawn, 1000 a minute
            with pytest.raises(QuotaExceededError) as refused:
                await domain.admission.admit(ctx, "b", 300, 300)
            assert refused.value.reason == "tokens_per_minute"
            assert refused.value.remaining_tokens == 400
            assert 'tokens per minute (TPM) of the tenant "acme"' in str(refused.value)
            # Only 350 of the 600 reserved were used: the rest flows back at once.
            await domain.admission.settle(first, Usage(prompt_tokens=300, completion_tokens=50))
            await domain.admission.admit(ctx, "b", 300, 300)
            # More than the limit itself can never fit: refused as such, not told to wait.
            with pytest.raises(LimitUnreachableError) as never:
                await domain.admission.admit(ctx, "huge", 900, 200)
            assert (never.value.limit, never.value.requested) == (1000, 1100)

    asyncio.run(body())


def test_concurrency_cap_is_released_by_settle_once(open_domain) -> None:
    async def body() -> None:
        async with open_domain() as domain:
            ctx = await _tenant(domain, max_concurrent_requests=2)
            a = await domain.admission.admit(ctx, "a", 1, 1)
            await domain.admission.admit(ctx, "b", 1, 1)
            with pytest.raises(QuotaExceededError) as refused:
                await domain.admission.admit(ctx, "c", 1, 1)
            assert refused.value.reason == "max_concurrent_requests"
            usage = Usage(prompt_tokens=1, completion_tokens=1)
            assert await domain.admission.settle(a, usage) is True
            assert await domain.admission.settle(a, usage) is False  # idempotent
            await domain.admission.admit(ctx, "c", 1, 1)
            with pytest.raises(QuotaExceededError):  # the double settle freed nothing extra
                await domain.admission.admit(ctx, "d", 1, 1)
            with pytest.raises(DuplicateRequestError):
                await domain.admission.admit(ctx, "c", 1, 1)

    asyncio.run(body())


def test_prompt_limit_and_suspension_are_checked_fresh(open_domain) -> None:
    async def body() -> None:
        async with open_domain() as domain:
            ctx = await _tenant(domain, max_prompt_tokens=100)
            await domain.admission.admit(ctx, "ok", 100, 1000)
            with pytest.raises(PromptTooLargeError) as too_large:
                await domain.admission.admit(ctx, "big", 101, 1)
            assert (too_large.value.limit, too_large.value.prompt_tokens) == (100, 101)
            await domain.tenants.update(ctx.tenant_id, TenantPatch(status="suspended"))
            with pytest.raises(TenantSuspendedError):
                await domain.admission.admit(ctx, "late", 1, 1)  # ctx is stale, the row is not

    asyncio.run(body())


def test_monthly_budget_reserves_then_charges_actual_usage(open_domain) -> None:
    async def body() -> None:
        async with open_domain() as domain:
            ctx = await _tenant(domain, monthly_token_budget=1000)
            a = await domain.admission.admit(ctx, "a", 200, 400)  # reserves 600
            with pytest.raises(BudgetExhaustedError) as refused:
                await domain.admission.admit(ctx, "b", 200, 400)
            err = refused.value
            assert (err.reason, err.budget, err.remaining) == ("monthly_token_budget", 1000, 400)
            assert (err.resets_at.day, err.resets_at.hour, err.resets_at.tzinfo) == (1, 0, UTC)
            assert 0 < err.retry_after_s <= 31 * 86400  # until the next month starts
            await domain.admission.settle(a, Usage(prompt_tokens=200, completion_tokens=100))
            await domain.admission.admit(ctx, "b", 200, 400)  # 300 used + 600 reserved
            with pytest.raises(QuotaExceededError):
                await domain.admission.admit(ctx, "c", 50, 51)  # 901 + 100 > 1000
            await domain.admission.admit(ctx, "c", 50, 50)  # exactly at the budget

    asyncio.run(body())


def test_a_burst_of_admissions_and_settlements_is_exact(open_domain) -> None:
    """Forty requests admitted at once (SQLite: queued for its one connection), then settled at
    once: every one gets a slot up to the cap, the budget reserves and charges each exactly."""

    async def body() -> None:
        async with open_domain() as domain:
            ctx = await _tenant(domain, max_concurrent_requests=32, monthly_token_budget=10_000)
            results = await asyncio.gather(
                *(domain.admission.admit(ctx, f"b{i}", 100, 10) for i in range(40)),
                return_exceptions=True,
            )
            admitted = [r for r in results if not isinstance(r, BaseException)]
            refused = [r for r in results if isinstance(r, QuotaExceededError)]
            assert len(admitted) == 32 and len(refused) == 8
            assert {r.reason for r in refused} == {"max_concurrent_requests"}
            usage = Usage(prompt_tokens=100, completion_tokens=5)
            settled = await asyncio.gather(*(domain.admission.settle(a, usage) for a in admitted))
            assert all(settled)
            # Every slot is free again and the month holds exactly 32 x 105 used, nothing
            # reserved: the rest of the budget fits one request to the token, not one more.
            rest = 10_000 - 32 * 105
            await domain.admission.admit(ctx, "x", rest - 40, 40)
            with pytest.raises(QuotaExceededError) as over:
                await domain.admission.admit(ctx, "y", 1, 0)
            assert isinstance(over.value, BudgetExhaustedError)
            assert (over.value.reason, over.value.remaining) == ("monthly_token_budget", 0)

    asyncio.run(body())


def test_an_admission_says_how_much_of_the_budget_is_left_after_it(open_domain) -> None:
    """What degraded admission may spend while the database is away (web/tenancy/degraded.py)."""

    async def body() -> None:
        async with open_domain() as domain:
            ctx = await _tenant(domain, monthly_token_budget=1000)
            first = await domain.admission.admit(ctx, "a", 100, 200)
            assert first.remaining_budget == 700
            await domain.admission.settle(first, Usage(prompt_tokens=100, completion_tokens=50))
            second = await domain.admission.admit(ctx, "b", 100, 100)
            assert second.remaining_budget == 1000 - 150 - 200
            unlimited = await _tenant_named(domain, "free")
            assert (await domain.admission.admit(unlimited, "c", 10, 10)).remaining_budget is None

    asyncio.run(body())


async def _tenant_named(domain, name):
    tenant = await domain.tenants.create(TenantCreate(name=name))
    _, secret = await domain.keys.create_key(tenant.id)
    return await domain.keys.authenticate(secret)


def test_settlements_that_end_together_are_written_together(open_domain) -> None:
    """Settlements arriving while one is being written share the next transaction; the books
    end exactly where one-by-one settlements leave them, and a second settlement of a request
    id in the same group takes nothing."""

    async def body() -> None:
        async with open_domain() as domain:
            quotas = {"tokens_per_minute": 100_000, "monthly_token_budget": 100_000}
            contexts = []
            for name in ("t-a", "t-b", "t-c"):
                tenant = await domain.tenants.create(
                    TenantCreate(name=name, quotas=Quotas(**quotas))
                )
                _, secret = await domain.keys.create_key(tenant.id)
                contexts.append(await domain.keys.authenticate(secret))
            admitted = [
                await domain.admission.admit(ctx, f"{ctx.tenant_id}-{i}", 100 + i, 50, model="m")
                for ctx in contexts
                for i in range(5)
            ]
            usages = [Usage(prompt_tokens=100 + i % 5, completion_tokens=3 * i) for i in range(15)]
            commits: list[object] = []
            engine = domain.db.engine.sync_engine

            def count(connection: object) -> None:
                commits.append(connection)

            event.listen(engine, "commit", count)
            try:
                results = await asyncio.gather(
                    *(
                        domain.admission.settle(a, u, _event(a, u))
                        for a, u in zip(admitted, usages, strict=True)
                    ),
                    domain.admission.settle(admitted[3], usages[3]),  # a second one: nothing
                )
            finally:
                event.remove(engine, "commit", count)
            assert results == [True] * 15 + [False]
            assert len(commits) == 1  # all sixteen arrived before the first was written
            async with domain.db.sessions() as session:
                buckets = {
                    b.tenant_id: (b.in_flight, b.tokens_drawn)
                    for b in (await session.scalars(select(RateBucket))).all()
                }
                budgets = {
                    b.tenant_id: (b.used, b.reserved)
                    for b in (await session.scalars(select(TokenBudget))).all()
                }
                events = (await session.scalars(select(UsageEventRow))).all()
            for t, ctx in enumerate(contexts):
                used = sum(usages[5 * t + i].total_tokens for i in range(5))
                assert buckets[ctx.tenant_id] == (0, used)  # the unused tokens flowed back
                assert budgets[ctx.tenant_id] == (used, 0)
            assert sorted((e.request_id, e.completion_tokens) for e in events) == sorted(
                (a.request_id, u.completion_tokens) for a, u in zip(admitted, usages, strict=True)
            )

    asyncio.run(body())


def _event(admission: Admission, usage: Usage) -> UsageEvent:
    return UsageEvent(
        request_id=admission.request_id,
        tenant_id=admission.tenant_id,
        key_id=admission.key_id,
        model="m",
        prompt_tokens=usage.prompt_tokens,
        cached_tokens=0,
        completion_tokens=usage.completion_tokens,
        status="ok",
        started_at=admission.admitted_at,
        finished_at=admission.admitted_at,
    )
