"""Key lifecycle at the gateway: model lists and scopes, expiry, rotation and per-key limits,
over the SQL tenancy on SQLite with the scripted engine."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from litestar.testing import TestClient

from tenants import Database, TenantDomain
from tenants.key_policy import KeyRotate, KeySpec
from tenants.schemas import TenantCreate
from tests.integration.gateway_fakes import MODEL, make_runtime, settings
from tests.support.postgres import migrate
from web.app import create_app

SPECS = {
    "full": KeySpec(name="full"),
    "other_model": KeySpec(name="other", models=["some-other-model"]),
    "this_model": KeySpec(name="this", models=[MODEL]),
    "usage_only": KeySpec(name="usage", scopes=["usage:read"]),
    "expired": KeySpec(name="expired", expires_at=datetime.now(UTC) - timedelta(seconds=1)),
    "one_rpm": KeySpec(name="slow", requests_per_minute=1),
}


async def _keys(url: str, spool: Path) -> dict[str, str]:
    db = await Database.connect(url)
    domain = await TenantDomain.open(db, spool_path=spool)
    try:
        tenant = await domain.tenants.create(TenantCreate(name="acme"))
        keys = {}
        for label, spec in SPECS.items():
            keys[label] = (await domain.keys.create_key(tenant.id, spec))[1]
        info, keys["rotated_out"] = await domain.keys.create_key(tenant.id, "rotated")
        _, keys["successor"], _ = await domain.keys.rotate_key(
            info.id, KeyRotate(overlap_seconds=0)
        )
        return keys
    finally:
        await domain.close()


@pytest.fixture
def gateway(tiny_llama_dir: Path, tmp_path: Path) -> Iterator[tuple[TestClient[Any], Any]]:
    url = f"sqlite+aiosqlite:///{tmp_path / 'atrium.db'}"
    asyncio.run(migrate(url))
    keys = asyncio.run(_keys(url, tmp_path / "seed.spool"))
    runtime, _ = make_runtime(tiny_llama_dir)
    config = settings(database_url=url, usage_spool_path=str(tmp_path / "usage.spool"))
    with TestClient(create_app(config, engine=runtime, include_admin=False)) as client:

        def call(label: str, path: str = "/v1/completions") -> Any:
            auth = {"Authorization": f"Bearer {keys[label]}"}
            if path == "/v1/models":
                return client.get(path, headers=auth)
            body = {"model": MODEL, "prompt": "keys", "max_tokens": 2}
            return client.post(path, json=body, headers=auth)

        yield client, call


def _error(response: Any, status: int, code: str) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code
    return str(error["message"])


def test_a_key_calls_only_its_models_and_scopes(gateway: tuple[TestClient[Any], Any]) -> None:
    _, call = gateway
    assert call("full").status_code == 200
    assert call("this_model").status_code == 200
    # A model outside the key's list is answered as if it did not exist (as OpenAI does).
    message = _error(call("other_model"), 404, "model_not_found")
    assert "does not exist or you do not have access" in message
    assert call("other_model", "/v1/models").json()["data"] == []
    assert [m["id"] for m in call("this_model", "/v1/models").json()["data"]] == [MODEL]
    # A read-only key may list models but not generate.
    assert "`inference` scope" in _error(call("usage_only"), 401, "missing_scope")
    chat = call("usage_only", "/v1/chat/completions")
    _error(chat, 401, "missing_scope")
    assert call("usage_only", "/v1/models").status_code == 200


def test_expired_and_rotated_out_keys_are_invalid(gateway: tuple[TestClient[Any], Any]) -> None:
    _, call = gateway
    _error(call("expired"), 401, "invalid_api_key")
    _error(call("rotated_out"), 401, "invalid_api_key")
    assert call("successor").status_code == 200


def test_a_key_limit_refuses_with_429(gateway: tuple[TestClient[Any], Any]) -> None:
    _, call = gateway
    first = call("one_rpm")
    assert first.status_code == 200
    assert first.headers["x-ratelimit-limit-requests"] == "1"
    refused = call("one_rpm")
    _error(refused, 429, "rate_limit_exceeded")
    assert float(refused.headers["Retry-After"]) > 0
    assert call("full").status_code == 200  # the tenant itself has no limit
