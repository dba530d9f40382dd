"""`atrium db`, `atrium tenants create` and `atrium keys create` print what operators script on."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from tenants.auth_cache import AuthCache
from tenants.database import Database
from tenants.key_service import KeyService
from tenants.server_secrets import load_key_secret
from web.cli import main


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    status = main(argv)
    out, err = capsys.readouterr()
    return status, out, err


@pytest.fixture
def url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.delenv("ATRIUM_SERVER_SECRET", raising=False)
    value = f"sqlite+aiosqlite:///{tmp_path / 'cli.db'}"
    monkeypatch.setenv("ATRIUM_DATABASE_URL", value)
    return value


def test_db_upgrade_then_current(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(["db", "current"], capsys)
    assert status == 0 and out.strip() == "(empty database)"
    status, upgraded, _ = run(["db", "upgrade"], capsys)
    assert status == 0 and upgraded.strip() not in ("", "(empty database)")
    status, current, _ = run(["db", "current", "--database-url", url], capsys)
    assert current == upgraded


def test_db_check_fails_until_the_schema_is_at_the_newest_revision(
    url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    status, _, err = run(["db", "check"], capsys)
    assert status == 1 and "empty database" in err
    _, upgraded, _ = run(["db", "upgrade"], capsys)
    status, out, _ = run(["db", "check"], capsys)
    assert status == 0 and out == upgraded

    async def step_back() -> None:
        db = await Database.connect(url)
        try:
            await db.downgrade("-1")
        finally:
            await db.close()

    asyncio.run(step_back())
    status, out, err = run(["db", "check"], capsys)
    assert status == 1 and out == "" and f"expects {upgraded.strip()}" in err


def test_tenants_create_prints_the_tenant(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(["tenants", "create", "acme", "--weight", "2.5"], capsys)
    tenant = json.loads(out)
    assert status == 0
    assert tenant["name"] == "acme" and tenant["weight"] == 2.5 and tenant["status"] == "active"
    assert tenant["id"] and tenant["quotas"]["requests_per_minute"] is None
    status, _, err = run(["tenants", "create", "acme"], capsys)
    assert status == 2 and "exists" in err


def test_keys_create_prints_a_working_key(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    _, out, _ = run(["tenants", "create", "acme"], capsys)
    tenant_id = json.loads(out)["id"]
    status, out, _ = run(["keys", "create", tenant_id, "--name", "ci"], capsys)
    issued = json.loads(out)
    assert status == 0 and {"id", "key"} <= set(issued)

    async def authenticate() -> str:
        db = await Database.connect(url)
        try:
            keys = KeyService(db, await load_key_secret(db), AuthCache())
            return (await keys.authenticate(issued["key"])).tenant_id
        finally:
            await db.close()

    assert asyncio.run(authenticate()) == tenant_id
    status, _, err = run(["keys", "create", "tn_missing"], capsys)
    assert status == 2 and "not found" in err
