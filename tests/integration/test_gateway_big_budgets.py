"""A tenant whose budgets pass 32 bits (3,000,000,000 tokens, 10,000 currency units a month) is
served through the gateway, charged exactly, and refused with a 429 when the money runs out, on
SQLite and PostgreSQL (where a 32-bit bind once turned every request into a 500)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import msgspec
import pytest
from litestar.testing import TestClient
from sqlalchemy import select

from tenants import Database, TenantDomain
from tenants.models import TokenBudget
from tenants.records import PriceSet
from tenants.schemas import Quotas
from tests.integration.gateway_fakes import MODEL, make_runtime, settings
from tests.integration.pg_gateway import create_tenant, migrated_database
from tests.support.postgres import migrate, pg_url
from web.app import create_app

TOKENS = 3_000_000_000
MONEY = 10_000 * 1_000_000  # micro-units
# 1,000.00 per million output tokens: 4 output tokens cost 4,000 micro-units.
PRICE = PriceSet(input_per_million=0, cached_input_per_million=0, output_per_million=1_000_000_000)


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        url = f"sqlite+aiosqlite:///{tmp_path / 'atrium.db'}"
        asyncio.run(migrate(url))
        yield url
        return
    with migrated_database() as name:
        yield pg_url(name)


async def _price_and_spend(url: str, spool: Path, spent: int | None = None) -> tuple[int, int]:
    """Set the model's price (and, given ``spent``, the month's money used so far); returns
    (tokens used, money used) of the month."""
    db = await Database.connect(url)
    domain = await TenantDomain.open(db, spool_path=spool)
    try:
        since = datetime.now(UTC) - timedelta(days=1)
        await domain.prices.set_price(MODEL, msgspec.structs.replace(PRICE, effective_from=since))
        async with db.transaction() as session:
            row = await session.scalar(select(TokenBudget))
            if row is None:
                return 0, 0
            if spent is not None:
                row.cost_used = spent
            return int(row.used), int(row.cost_used)
    finally:
        await domain.close()


def test_budgets_past_32_bits_through_the_gateway(
    database_url: str, tmp_path: Path, tiny_llama_dir: Path
) -> None:
    spool = tmp_path / "seed.spool"
    asyncio.run(_price_and_spend(database_url, spool))
    quotas = Quotas(monthly_token_budget=TOKENS, monthly_cost_budget=MONEY)
    (key,) = asyncio.run(create_tenant(database_url, spool, "big", quotas, 1))
    runtime, _ = make_runtime(tiny_llama_dir)
    config = settings(database_url=database_url, usage_spool_path=str(tmp_path / "usage.spool"))
    auth = {"Authorization": f"Bearer {key}"}
    body = {"model": MODEL, "prompt": "a prompt", "max_tokens": 4}
    with TestClient(create_app(config, engine=runtime, include_admin=False)) as client:
        served = client.post("/v1/completions", json=body, headers=auth)
        assert served.status_code == 200, served.text
        assert served.json()["usage"]["completion_tokens"] == 4
    used, money = asyncio.run(_price_and_spend(database_url, spool))
    assert used == served.json()["usage"]["total_tokens"]
    assert money == 4_000
    # 3,999 micro-units short of the 10,000 units: the worst case (4,000) no longer fits.
    asyncio.run(_price_and_spend(database_url, spool, spent=MONEY - 3_999))
    with TestClient(create_app(config, engine=runtime, include_admin=False)) as client:
        refused = client.post("/v1/completions", json=body, headers=auth)
        assert refused.status_code == 429, refused.text
        error = refused.json()["error"]
        assert (error["type"], error["code"]) == ("insufficient_quota", "insufficient_quota")
        assert "monthly cost budget of the tenant" in error["message"]
        assert "0.003999 is left" in error["message"] and "up to 0.004000" in error["message"]
        # The console's refusal log names the tenant and the budget that refused it.
        log = client.app.state.generation.refusals
        [(tenant_id, reason, count)] = [(c.tenant_id, c.reason, c.count) for c in log.totals()]
        assert (tenant_id.startswith("tn_"), reason, count) == (True, "monthly_cost_budget", 1)
        assert log.latest()[0].status == 429
        body["max_tokens"] = 3  # 3,000 fit
        assert client.post("/v1/completions", json=body, headers=auth).status_code == 200
