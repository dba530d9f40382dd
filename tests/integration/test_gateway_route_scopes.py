"""Every tenant-facing route checks its key's scope: enumerated from the app's route table, each
route a tenant key opens refuses a key that has only the other scope (401 missing_scope), so a
new route without a scope check fails here. Listing models is the one route any key may call."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from litestar.routes import HTTPRoute
from litestar.testing import TestClient

from tenants import Database, TenantDomain
from tenants.key_policy import KeySpec
from tenants.schemas import SCOPES, TenantCreate
from tests.integration.gateway_fakes import MODEL, make_runtime, settings
from tests.support.postgres import migrate
from web.app import create_app

ANY_SCOPE = {("GET", "/v1/models")}  # a read-only key names the models its usage shows
# Routes a tenant key must open: the enumeration below finds at least these.
KNOWN = {
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("GET", "/v1/models/{model_id:path}"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
    ("GET", "/v1/usage"),
    ("POST", "/v1/files"),
    ("GET", "/v1/batches/{batch_id:str}"),
}


async def _keys(url: str, spool: Path) -> dict[str, str]:
    """One key per scope, holding that scope only."""
    db = await Database.connect(url)
    domain = await TenantDomain.open(db, spool_path=spool)
    try:
        tenant = await domain.tenants.create(TenantCreate(name="acme"))
        return {
            scope: (await domain.keys.create_key(tenant.id, KeySpec(name=scope, scopes=[scope])))[1]
            for scope in SCOPES
        }
    finally:
        await domain.close()


@pytest.fixture
def gateway(
    tiny_llama_dir: Path, tmp_path: Path
) -> Iterator[tuple[TestClient[Any], dict[str, str]]]:
    url = f"sqlite+aiosqlite:///{tmp_path / 'atrium.db'}"
    asyncio.run(migrate(url))
    keys = asyncio.run(_keys(url, tmp_path / "seed.spool"))
    runtime, _ = make_runtime(tiny_llama_dir)
    config = settings(database_url=url, usage_spool_path=str(tmp_path / "usage.spool"))
    with TestClient(create_app(config, engine=runtime)) as client:
        yield client, keys


def _routes(client: TestClient[Any]) -> list[tuple[str, str]]:
    """(method, path template) of every HTTP route of the app."""
    return sorted(
        (method, route.path)
        for route in client.app.routes
        if isinstance(route, HTTPRoute)
        for method in route.methods
        if method not in ("OPTIONS", "HEAD")
    )


def _call(client: TestClient[Any], method: str, template: str, key: str | None) -> tuple[int, str]:
    path = re.sub(r"\{[^}]*\}", MODEL if "model_id" in template else "x", template)
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    body = {"model": MODEL, "prompt": "scopes", "max_tokens": 1}
    json = body if method in ("POST", "PUT", "PATCH") else None
    response = client.request(method, path, headers=headers, json=json)
    try:
        code = str(response.json()["error"]["code"])
    except (ValueError, KeyError, TypeError):
        code = ""
    return response.status_code, code


def test_every_tenant_route_refuses_a_key_without_its_scope(
    gateway: tuple[TestClient[Any], dict[str, str]],
) -> None:
    client, keys = gateway
    tenant_routes: dict[tuple[str, str], set[str]] = {}  # route: scopes refused there
    for method, template in _routes(client):
        if _call(client, method, template, None) != (401, "invalid_api_key"):
            continue  # no tenant key opens it (health, metrics, admin, console, engines, docs)
        tenant_routes[(method, template)] = {
            scope
            for scope, key in keys.items()
            if _call(client, method, template, key) == (401, "missing_scope")
        }
    assert tenant_routes.keys() >= KNOWN
    for route, refused in tenant_routes.items():
        if route in ANY_SCOPE:
            assert refused == set(), route
        else:  # exactly one scope opens it: the key without it is refused
            assert len(refused) == len(SCOPES) - 1, (route, refused)
