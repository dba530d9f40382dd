"""Budgets past 32 bits: 3,000,000,000 tokens a month and a cost budget of 10,000 currency units
(10^10 micro-units) are admitted, refused and settled exactly on SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import msgspec
import pytest
from sqlalchemy import select

from tenants import TenantDomain
from tenants.errors import BudgetExhaustedError, QuotaExceededError
from tenants.models import TokenBudget
from tenants.records import PriceSet
from tenants.schemas import AuthContext, Quotas, TenantCreate, Usage
from tests.integration.tenants.conftest import FakeClock, OpenDomain

INT32_MAX = 2**31 - 1
TOKENS = 3_000_000_000
MONEY = 10_000 * 1_000_000  # 10,000 units in micro-units
# Per million tokens, in micro-units: 2.00 input, 0.50 cached input, 8.00 output.
PRICE = PriceSet(input_per_million=2_000_000, cached_input_per_million=500_000,
                 output_per_million=8_000_000)  # fmt: skip


async def _books(domain: TenantDomain, tenant_id: str) -> tuple[int, int, int, int]:
    """used, reserved, cost_used, cost_reserved of the tenant's month."""
    async with domain.db.sessions() as session:
        row = await session.scalar(select(TokenBudget).where(TokenBudget.tenant_id == tenant_id))
        assert row is not None
        return row.used, row.reserved, row.cost_used, row.cost_reserved


async def _tenant(domain: TenantDomain, quotas: Quotas) -> tuple[str, AuthContext]:
    tenant = await domain.tenants.create(TenantCreate(name="big", quotas=quotas))
    _, secret = await domain.keys.create_key(tenant.id)
    return tenant.id, await domain.keys.authenticate(secret)


def test_a_token_budget_of_three_billion(open_domain: OpenDomain) -> None:
    async def body() -> None:
        async with open_domain() as domain:
            tenant_id, ctx = await _tenant(domain, Quotas(monthly_token_budget=TOKENS))
            need = 2_500_000_000  # itself past 32 bits
            first = await domain.admission.admit(ctx, "a", 1000, need - 1000)
            assert need > INT32_MAX
            assert first.remaining_budget == TOKENS - need
            assert await _books(domain, tenant_id) == (0, need, 0, 0)
            with pytest.raises(QuotaExceededError) as refused:
                await domain.admission.admit(ctx, "b", 1000, 600_000_000)
            assert refused.value.reason == "monthly_token_budget"
            assert isinstance(refused.value, BudgetExhaustedError)
            assert refused.value.remaining == TOKENS - need
            # 2,400,000,000 used: 100,000,000 unused tokens flow back to the month.
            used = Usage(prompt_tokens=1000, completion_tokens=2_399_999_000)
            assert await domain.admission.settle(first, used)
            assert await _books(domain, tenant_id) == (2_400_000_000, 0, 0, 0)
            second = await domain.admission.admit(ctx, "b", 1000, 599_999_000)
            assert second.remaining_budget == 0
            assert await domain.admission.settle(
                second, Usage(prompt_tokens=1000, completion_tokens=0)
            )
            assert await _books(domain, tenant_id) == (2_400_001_000, 0, 0, 0)

    asyncio.run(body())


def test_a_cost_budget_of_ten_thousand_units(open_domain: OpenDomain, clock: FakeClock) -> None:
    async def body() -> None:
        async with open_domain() as domain:
            since = clock.now - timedelta(days=1)
            await domain.prices.set_price("m", msgspec.structs.replace(PRICE, effective_from=since))
            quotas = Quotas(monthly_token_budget=TOKENS, monthly_cost_budget=MONEY)
            tenant_id, ctx = await _tenant(domain, quotas)
            # At worst 1,000 prompt tokens (2,000) and 1e9 output tokens (8e9 micro-units).
            first = await domain.admission.admit(ctx, "a", 1000, 1_000_000_000, model="m")
            worst = 2_000 + 8_000_000_000
            assert worst > INT32_MAX
            assert await _books(domain, tenant_id) == (0, 1_000_001_000, 0, worst)
            with pytest.raises(QuotaExceededError) as refused:  # 8e9 + 2.4e9 > 1e10
                await domain.admission.admit(ctx, "b", 1000, 300_000_000, model="m")
            assert refused.value.reason == "monthly_cost_budget"
            message = str(refused.value)  # money as amounts, exact past 2**53 micro-units
            assert "monthly cost budget of the tenant" in message and "10000.000000" in message
            assert "1999.998000 is left" in message and "up to 2400.002000" in message
            # 900,000,000 output tokens cost 7,200 units, the prompt 0.002.
            used = Usage(prompt_tokens=1000, completion_tokens=900_000_000)
            assert await domain.admission.settle(first, used)
            spent = 2_000 + 7_200_000_000
            assert await _books(domain, tenant_id) == (900_001_000, 0, spent, 0)
            second = await domain.admission.admit(ctx, "b", 1000, 300_000_000, model="m")
            assert await _books(domain, tenant_id) == (
                900_001_000,
                300_001_000,
                spent,
                2_000 + 2_400_000_000,
            )
            # 399,996,000 micro-units are left: a worst case of 2,000 more is refused, the exact
            # rest admitted.
            with pytest.raises(QuotaExceededError) as refused:
                await domain.admission.admit(ctx, "c", 1000, 49_999_500, model="m")
            assert refused.value.reason == "monthly_cost_budget"
            third = await domain.admission.admit(ctx, "c", 1000, 49_999_250, model="m")
            assert (await _books(domain, tenant_id))[2:] == (spent, MONEY - spent)
            assert await domain.admission.settle(
                second, Usage(prompt_tokens=1000, completion_tokens=0)
            )
            assert await domain.admission.settle(
                third, Usage(prompt_tokens=1000, completion_tokens=0)
            )
            assert await _books(domain, tenant_id) == (900_003_000, 0, spent + 4_000, 0)

    asyncio.run(body())
