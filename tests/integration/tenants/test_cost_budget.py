"""Monthly budgets in money: the worst case at the model's price is reserved at admission, what
was used is charged at settlement, a request that may not fit is refused; SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import msgspec
import pytest
from sqlalchemy import select

from tenants import TenantDomain
from tenants.errors import InvalidInputError, QuotaExceededError
from tenants.models import TokenBudget
from tenants.records import PriceSet
from tenants.schemas import Quotas, QuotasPatch, TenantCreate, TenantPatch, Usage
from tests.integration.tenants.conftest import FakeClock, OpenDomain

# Per million tokens, in micro-units: 2.00 input, 0.50 cached input, 8.00 output.
PRICE = PriceSet(input_per_million=2_000_000, cached_input_per_million=500_000,
                 output_per_million=8_000_000)  # fmt: skip


async def _spent(domain: TenantDomain, tenant_id: str) -> tuple[int, int]:
    async with domain.db.sessions() as session:
        row = await session.scalar(select(TokenBudget).where(TokenBudget.tenant_id == tenant_id))
        return (0, 0) if row is None else (row.cost_used, row.cost_reserved)


def test_reserve_the_worst_case_charge_what_was_used(
    open_domain: OpenDomain, clock: FakeClock
) -> None:
    async def body() -> None:
        async with open_domain() as domain:
            since = clock.now - timedelta(days=1)
            await domain.prices.set_price("m", msgspec.structs.replace(PRICE, effective_from=since))
            # 0.10; 1,000 prompt and 10,000 output tokens may cost 2,000 + 80,000 micro-units.
            quotas = Quotas(monthly_cost_budget=100_000)
            tenant = await domain.tenants.create(TenantCreate(name="acme", quotas=quotas))
            _, secret = await domain.keys.create_key(tenant.id)
            ctx = await domain.keys.authenticate(secret)
            first = await domain.admission.admit(ctx, "a", 1000, 10_000, model="m")
            assert await _spent(domain, tenant.id) == (0, 82_000)
            with pytest.raises(QuotaExceededError) as refused:  # twice 82,000 > 100,000
                await domain.admission.admit(ctx, "b", 1000, 10_000, model="m")
            assert refused.value.reason == "monthly_cost_budget"
            assert refused.value.retry_after_s > 0
            # Used: 600 uncached, 400 cached prompt tokens, 1,000 output: 1,200 + 200 + 8,000.
            usage = Usage(prompt_tokens=1000, cached_tokens=400, completion_tokens=1000)
            assert await domain.admission.settle(first, usage)
            assert await _spent(domain, tenant.id) == (9_400, 0)
            second = await domain.admission.admit(ctx, "b", 1000, 10_000, model="m")
            assert await _spent(domain, tenant.id) == (9_400, 82_000)
            await domain.admission.settle(second, Usage(prompt_tokens=1000, completion_tokens=0))
            assert await _spent(domain, tenant.id) == (11_400, 0)
            # A model without a price costs nothing; the token budget is untouched by money.
            free = await domain.admission.admit(ctx, "c", 1000, 10_000, model="unpriced")
            assert await _spent(domain, tenant.id) == (11_400, 0)
            await domain.admission.settle(free, Usage(prompt_tokens=1000, completion_tokens=5))
            # Lowering the budget below what was spent refuses even a free request.
            patch = TenantPatch(quotas=QuotasPatch(monthly_cost_budget=11_000))
            assert (
                await domain.tenants.update(tenant.id, patch)
            ).quotas.monthly_cost_budget == 11_000
            with pytest.raises(QuotaExceededError):
                await domain.admission.admit(ctx, "d", 1, 1, model="unpriced")
            # Without a cost budget nothing is priced or reserved.
            patch = TenantPatch(quotas=QuotasPatch(monthly_cost_budget=None))
            await domain.tenants.update(tenant.id, patch)
            await domain.admission.admit(ctx, "d", 1000, 10_000, model="m")
            assert await _spent(domain, tenant.id) == (11_400, 0)

    asyncio.run(body())


def test_a_negative_cost_budget_is_refused() -> None:
    with pytest.raises(InvalidInputError):
        Quotas(monthly_cost_budget=-1)
