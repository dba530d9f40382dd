"""The tenant database goes away while the gateway serves the tiny model, then comes back.

PostgreSQL is reached through a TCP proxy the test cuts: requests keep being served on keys
verified before the outage, and after recovery every request has exactly one usage row and the
monthly budget is charged exactly once for each.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from litestar import Litestar
from litestar.testing import TestClient

from tenants.schemas import Quotas
from tests.integration.gateway_fakes import settings
from tests.integration.pg_gateway import (
    ADMIN_TOKEN,
    create_tenant,
    migrated_database,
    read_books,
    revoke_key_of,
)
from tests.integration.tcp_proxy import TcpProxy
from tests.support.postgres import PG_HOST, PG_PORT, pg_url
from web.app import create_app

pytestmark = [pytest.mark.postgres, pytest.mark.slow]
QUOTAS = Quotas(max_concurrent_requests=4, requests_per_minute=1000, monthly_token_budget=10**6)
TIGHT = Quotas(max_concurrent_requests=1, max_prompt_tokens=30, monthly_token_budget=40)


class Gateway:
    """The app on the tiny model, its database behind ``proxy``, and what it answered."""

    def __init__(self, client: TestClient[Litestar], proxy: TcpProxy, url: str, model: str) -> None:
        self.client = client
        self.model = model
        self.proxy = proxy
        self.url = url
        self.served: dict[str, int] = {}  # request id -> total tokens, of every 200

    def complete(self, key: str, *, stream: bool = False) -> Any:
        body = {"model": self.model, "prompt": "the database is", "max_tokens": 4, "seed": 1}
        if stream:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
        response = self.client.post(
            "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}
        )
        if response.status_code == 200:
            usage = _last_usage(response.text) if stream else response.json()["usage"]
            self.served[response.headers["x-request-id"]] = usage["total_tokens"]
        return response


def _last_usage(text: str) -> dict[str, int]:
    frames = [f.removeprefix("data: ") for f in text.split("\n\n") if f.strip()]
    assert frames[-1] == "[DONE]"
    usage: dict[str, int] = json.loads(frames[-2])["usage"]
    return usage


@pytest.fixture
def gateway(tiny_llama_dir: Path, tmp_path: Path) -> Iterator[tuple[Gateway, list[str]]]:
    with migrated_database() as name, TcpProxy(PG_HOST, PG_PORT) as proxy:
        direct = pg_url(name)
        keys = asyncio.run(create_tenant(direct, tmp_path / "seed.spool", "outage", QUOTAS, 3))
        config = settings(
            model=str(tiny_llama_dir),
            dtype="float32",
            device="cpu",
            kv_cache_bytes=8 * 2**20,
            database_url=pg_url(name, proxy.port),
            admin_token=ADMIN_TOKEN,
            usage_spool_path=str(tmp_path / "usage.spool"),
        )
        app = create_app(config, include_admin=False)
        with TestClient(app) as client:
            auth = {"Authorization": f"Bearer {keys[0]}"}
            model = client.get("/v1/models", headers=auth).json()["data"][0]["id"]
            yield Gateway(client, proxy, direct, model), keys


def _accepted(gw: Gateway) -> set[str]:
    """The key ids the gateway would still serve from its fallback cache."""
    known = gw.client.app.state.tenancy.known

    async def read() -> set[str]:
        return set(known.accepted_key_ids())

    return gw.client.blocking_portal.call(read)  # on the app's loop: no concurrent mutation


def _wait_for(check: Any, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_requests_are_served_through_an_outage_and_metered_once(
    gateway: tuple[Gateway, list[str]], tmp_path: Path
) -> None:
    gw, (key, revoked, fresh) = gateway
    client = gw.client

    # Before: the database answers.
    assert client.get("/readyz").status_code == 200
    for _ in range(3):
        assert gw.complete(key).status_code == 200
    assert gw.complete(revoked).status_code == 200
    tenancy = client.app.state.tenancy
    assert len(_accepted(gw)) == 2
    asyncio.run(revoke_key_of(gw.url, tmp_path / "admin.spool", revoked))
    # Another process revoked it: the gateway learns of it at its next sweep.
    _wait_for(lambda: len(_accepted(gw)) == 1, timeout_s=30)

    # A tenant with tight quotas, seen once through the database before the outage.
    (tight,) = asyncio.run(create_tenant(gw.url, tmp_path / "tight.spool", "tight", TIGHT, 1))
    assert gw.complete(tight).status_code == 200

    gw.proxy.cut()
    during = [gw.complete(key) for _ in range(4)] + [gw.complete(key, stream=True)]
    assert [r.status_code for r in during] == [200] * 5
    ready = client.get("/readyz")
    assert ready.status_code == 503 and ready.json()["database"] is False
    assert gw.complete(revoked).status_code == 401  # revoked before the outage: still refused
    never_seen = gw.complete(fresh)
    assert never_seen.status_code == 503
    assert never_seen.json()["error"]["code"] == "database_unavailable"
    assert int(never_seen.headers["Retry-After"]) >= 1
    # In-process limits hold the tight tenant to its quotas, its budget to what was left.
    auth = {"Authorization": f"Bearer {tight}"}
    long_prompt = {"model": gw.model, "prompt": "word " * 60, "max_tokens": 2}
    too_long = client.post("/v1/completions", json=long_prompt, headers=auth)
    assert too_long.status_code == 413, too_long.text
    above_budget = {"model": gw.model, "prompt": "the database is", "max_tokens": 60}
    never = client.post("/v1/completions", json=above_budget, headers=auth)
    assert never.status_code == 400 and never.json()["error"]["code"] == "tokens_exceed_limit"
    over_budget = {**above_budget, "max_tokens": 20}  # 15 + 20: within the 40, above the 21 left
    refused = client.post("/v1/completions", json=over_budget, headers=auth)
    assert refused.status_code == 429 and "budget" in refused.json()["error"]["message"], (
        refused.text
    )
    assert gw.complete(tight).status_code == 200  # within what was left
    metrics = client.get("/metrics").text
    assert "atrium_database_up 0.0" in metrics
    assert "atrium_admissions_degraded_total 6.0" in metrics
    assert Path(gw.client.app.state.settings.usage_spool_path).stat().st_size > 0

    gw.proxy.restore()
    _wait_for(lambda: client.get("/readyz").status_code == 200, timeout_s=20)
    assert gw.complete(key).status_code == 200
    assert gw.complete(fresh).status_code == 200  # verified now that the database answers
    assert gw.complete(revoked).status_code == 401

    def all_stored() -> bool:
        books = asyncio.run(read_books(gw.url))
        return len(books.request_ids) >= len(gw.served) and books.reservations == 0

    _wait_for(all_stored, timeout_s=30)
    # Every event recorded so far is now stored or spooled, and the spool is empty: nothing
    # is on its way that could still land as a duplicate.
    client.blocking_portal.call(tenancy._meter.flush)
    assert not tenancy._meter.spooled and tenancy._meter.held == 0 and not tenancy._pending
    books = asyncio.run(read_books(gw.url))
    assert sorted(books.request_ids) == sorted(gw.served)  # one row per request, none twice
    assert len(gw.served) == 3 + 1 + 1 + 5 + 1 + 2
    # Every request's tokens are charged once: by settle, or by its replayed usage event.
    assert books.budget_used == sum(gw.served.values())
    assert (books.budget_reserved, books.reservations, books.in_flight) == (0, 0, 0)
    assert "atrium_database_up 1.0" in client.get("/metrics").text
