"""`GET /v1/usage`: a key sees its own tenant's usage, quotas, budget and rate state, and never
another tenant's; on SQLite and PostgreSQL, through the gateway with the scripted engine."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import ExitStack
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import msgspec
import pytest
from litestar.testing import TestClient

from tenants import Database, TenantDomain
from tenants.key_policy import KeySpec
from tenants.records import PriceSet
from tenants.schemas import Quotas, TenantCreate
from tests.integration.gateway_fakes import MODEL, make_runtime, settings
from tests.integration.pg_gateway import migrated_database
from tests.support.postgres import migrate, pg_url
from web.app import create_app

# Slow refill (0.1 request and 1 token a second) so the state read back is what was drawn.
QUOTAS = Quotas(
    requests_per_minute=6,
    tokens_per_minute=60,
    monthly_token_budget=100_000,
    monthly_cost_budget=1_000_000,
)
# A micro-unit per prompt token and two per output token.
PRICE = PriceSet(input_per_million=10**6, cached_input_per_million=0, output_per_million=2 * 10**6)


async def _keys(url: str, spool: Path) -> dict[str, str]:
    db = await Database.connect(url)
    domain = await TenantDomain.open(db, spool_path=spool)
    try:
        since = datetime.now(UTC) - timedelta(days=1)
        await domain.prices.set_price(MODEL, msgspec.structs.replace(PRICE, effective_from=since))
        acme = await domain.tenants.create(TenantCreate(name="acme", quotas=QUOTAS))
        other = await domain.tenants.create(TenantCreate(name="other"))
        return {
            "acme": (await domain.keys.create_key(acme.id, "full"))[1],
            "acme_read": (await domain.keys.create_key(acme.id, KeySpec(scopes=["usage:read"])))[1],
            "acme_infer": (
                await domain.keys.create_key(acme.id, KeySpec(name="i", scopes=["inference"]))
            )[1],
            "other": (await domain.keys.create_key(other.id, "full"))[1],
        }
    finally:
        await domain.close()


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def gateway(
    request: pytest.FixtureRequest, tiny_llama_dir: Path, tmp_path: Path
) -> Iterator[tuple[TestClient[Any], dict[str, str]]]:
    with ExitStack() as stack:
        if request.param == "sqlite":
            url = f"sqlite+aiosqlite:///{tmp_path / 'atrium.db'}"
            asyncio.run(migrate(url))
        else:
            url = pg_url(stack.enter_context(migrated_database()))
        keys = asyncio.run(_keys(url, tmp_path / "seed.spool"))
        runtime, _ = make_runtime(tiny_llama_dir)
        config = settings(database_url=url, usage_spool_path=str(tmp_path / "usage.spool"))
        app = create_app(config, engine=runtime, include_admin=False)
        yield stack.enter_context(TestClient(app)), keys


def _usage(client: TestClient[Any], key: str, query: str = "") -> Any:
    return client.get(f"/v1/usage{query}", headers={"Authorization": f"Bearer {key}"})


def _generate(client: TestClient[Any], key: str, max_tokens: int) -> None:
    body = {"model": MODEL, "prompt": "usage", "max_tokens": max_tokens}
    response = client.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})
    assert response.status_code == 200, response.text


def _settled(client: TestClient[Any], key: str, requests: int) -> Any:
    """The statement once the meter has stored ``requests`` events (it writes in the
    background)."""
    deadline = time.monotonic() + 10
    while True:
        body = _usage(client, key).json()
        counted = sum(r["num_model_requests"] for b in body["data"] for r in b["results"])
        if counted >= requests and body["rate_limits"]["in_flight"] == 0:
            return body
        assert time.monotonic() < deadline, body
        time.sleep(0.05)


def test_a_key_reads_its_own_usage_quotas_budget_and_rates(
    gateway: tuple[TestClient[Any], dict[str, str]],
) -> None:
    client, keys = gateway
    for max_tokens in (3, 4):
        _generate(client, keys["acme"], max_tokens)
    _generate(client, keys["other"], 5)
    body = _settled(client, keys["acme_read"], 2)
    assert body["object"] == "tenant.usage" and body["tenant_name"] == "acme"
    today = datetime.now(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    [bucket] = body["data"]
    assert (bucket["start_time"], bucket["end_time"]) == (
        int(today.timestamp()),
        int(today.timestamp()) + 86400,
    )
    [result] = bucket["results"]
    assert result["model"] == MODEL and result["num_model_requests"] == 2
    assert result["output_tokens"] == 7  # the scripted engine emits max_tokens tokens
    used = result["input_tokens"] + result["output_tokens"]
    assert body["quotas"]["monthly_token_budget"] == 100_000
    budget = body["budget"]
    assert (budget["limit"], budget["used"], budget["reserved"]) == (100_000, used, 0)
    assert budget["remaining"] == 100_000 - used
    assert budget["period"] == today.strftime("%Y-%m")
    cost = result["input_tokens"] + 2 * result["output_tokens"]
    assert (budget["cost_limit"], budget["cost_used"], budget["cost_reserved"]) == (10**6, cost, 0)
    assert budget["cost_remaining"] == 10**6 - cost
    rates = body["rate_limits"]
    assert rates["limit_requests"] == 6 and rates["remaining_requests"] in (4, 5)
    assert rates["limit_tokens"] == 60 and 60 - used <= rates["remaining_tokens"] < 60
    # The other tenant sees only its own request, and no budget.
    theirs = _settled(client, keys["other"], 1)
    assert theirs["tenant_name"] == "other"
    assert [r["output_tokens"] for r in theirs["data"][0]["results"]] == [5]
    assert theirs["budget"]["limit"] is None and theirs["budget"]["remaining"] is None
    assert theirs["budget"]["cost_limit"] is None and theirs["budget"]["cost_used"] == 0


def test_scopes_windows_and_bad_queries(
    gateway: tuple[TestClient[Any], dict[str, str]],
) -> None:
    client, keys = gateway
    refused = _usage(client, keys["acme_infer"])
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "missing_scope"
    assert _usage(client, "sk-nobody").status_code == 401
    # A window before any usage is empty but still carries the state of now.
    empty = _usage(client, keys["acme"], "?start_time=86400&end_time=172800&bucket_width=1d")
    assert empty.status_code == 200 and empty.json()["data"] == []
    assert empty.json()["start_time"] == 86400 and empty.json()["end_time"] == 172800
    for query, param in [
        ("?start_time=yesterday", "start_time"),
        ("?start_time=-5", "start_time"),
        ("?start_time=200&end_time=100", "end_time"),
        ("?start_time=0&end_time=99999999", "end_time"),
        ("?bucket_width=1h", "bucket_width"),
        ("?tenant_id=other", "tenant_id"),
    ]:
        response = _usage(client, keys["acme"], query)
        assert response.status_code == 400, (query, response.text)
        assert response.json()["error"]["param"] == param
