"""Admission: prompt limit, per-minute buckets, concurrency, monthly budget and settlement."""

from __future__ import annotations

import asyncio

import pytest

from tenants.errors import (
    DuplicateRequestError,
    PromptTooLargeError,
    QuotaExceededError,
    TenantSuspendedError,
)
from tenants.schemas import Quotas, TenantCreate, TenantPatch, Usage


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
            with pytest.raises(QuotaExceededError) as refused:
                await domain.admission.admit(ctx, "b", 300, 300)
            assert refused.value.reason == "tokens_per_minute"
            assert refused.value.remaining_tokens == 400
            # Only 350 of the 600 reserved were used: the rest flows back at once.
            await domain.admission.settle(first, Usage(prompt_tokens=300, completion_tokens=50))
            await domain.admission.admit(ctx, "b", 300, 300)
            with pytest.raises(QuotaExceededError) as never:
                await domain.admission.admit(ctx, "huge", 900, 200)
            assert never.value.retry_after_s == 60.0

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
            with pytest.raises(QuotaExceededError) as refused:
                await domain.admission.admit(ctx, "b", 200, 400)
            err = refused.value
            assert (err.reason, err.limit_tokens, err.remaining_tokens) == (
                "monthly_token_budget",
                1000,
                400,
            )
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
            assert (over.value.reason, over.value.remaining_tokens) == ("monthly_token_budget", 0)

    asyncio.run(body())


def test_an_admission_says_how_much_of_the_budget_is_left_after_it(open_domain) -> None:
    """What degraded admission may spend while the database is away (web/degraded_admission)."""

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
