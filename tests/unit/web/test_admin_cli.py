"""`atrium db`, `atrium tenants`, `atrium keys` and `atrium usage` print what operators script on
and read: whole ids, names, models."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime
from pathlib import Path

import pytest

from tenants.auth_cache import AuthCache
from tenants.database import Database
from tenants.key_service import KeyService
from tenants.records import UsageEvent
from tenants.server_secrets import load_key_secret
from tenants.usage_store import UsageStore
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


def test_a_tenant_is_named_by_its_id_or_its_name(
    url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    status, out, err = run(["tenants", "create", "bad name!"], capsys)
    assert status == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "lowercase letters, digits" in err and "'bad name!'" in err
    _, out, _ = run(["tenants", "create", "acme", "--json"], capsys)
    tenant_id = json.loads(out)["id"]
    status, out, _ = run(["keys", "create", "acme", "--name", "laptop", "--json"], capsys)
    assert status == 0 and json.loads(out)["tenant_id"] == tenant_id
    _, out, _ = run(["tenants", "update", "acme", "--weight", "3", "--json"], capsys)
    assert json.loads(out)["weight"] == 3.0
    _, by_id, _ = run(["keys", "list", tenant_id, "--json"], capsys)
    assert [key["name"] for key in json.loads(by_id)] == ["laptop"]
    status, _, err = run(["keys", "list", "globex"], capsys)
    assert status == 2 and err.strip() == "atrium keys list: tenant 'globex' not found"


def test_key_tables_show_whole_ids_and_fit_the_terminal(
    url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    run(["tenants", "create", "acme"], capsys)
    ids = []
    for name in ("laptop", "ci"):
        _, out, _ = run(["keys", "create", "acme", "--name", name, "--expires-in", "90d"], capsys)
        ids.append(json.loads(out)["id"])
    _, out, _ = run(["keys", "rotate", ids[1], "--json"], capsys)
    ids.append(json.loads(out)["id"])
    monkeypatch.setenv("COLUMNS", "80")
    status, table, _ = run(["keys", "list", "acme", "--table"], capsys)
    assert status == 0 and all(len(line) <= 80 for line in table.splitlines()), table
    for key_id in ids:
        assert any(f" {key_id} " in line for line in table.splitlines()), (key_id, table)
    assert "laptop" in table and "replaced" in table and "active" in table
    _, wide, _ = run(["keys", "list", "acme", "--table", "--wide"], capsys)
    rows = [line for line in wide.splitlines() if any(key_id in line for key_id in ids)]
    assert len(rows) == 3 and "replaced by" in wide  # one line a key, every column
    assert any(line.count("key_") == 2 for line in rows)  # the rotated key and its successor


def test_usage_names_the_tenant_and_the_model(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    _, out, _ = run(["tenants", "create", "acme"], capsys)
    tenant_id = json.loads(out)["id"]
    at = datetime(2031, 3, 4, 9, tzinfo=UTC)
    fields = {"tenant_id": tenant_id, "key_id": None, "prompt_tokens": 100, "cached_tokens": 0}
    fields |= {"completion_tokens": 5, "status": "ok", "started_at": at, "finished_at": at}
    events = [UsageEvent(request_id=f"r-{m}", model=m, **fields) for m in ("small", "big")]

    async def write() -> None:
        db = await Database.connect(url)
        try:
            await UsageStore(db).write(events)
        finally:
            await db.close()

    asyncio.run(write())
    window = ["--start", "2031-03-01", "--end", "2031-04-01"]
    _, out, _ = run(["usage", "--tenant", "acme", *window, "--json"], capsys)
    rows = [(r["tenant_name"], r["model"], r["prompt_tokens"]) for r in json.loads(out)]
    assert rows == [("acme", "big", 100), ("acme", "small", 100)]
    _, table, _ = run(["usage", *window, "--table"], capsys)
    assert "acme" in table and "small" in table and tenant_id not in table
    _, wide, _ = run(["usage", *window, "--table", "--wide"], capsys)
    assert tenant_id in wide


def test_db_commands_print_json_on_request(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(["db", "check", "--json"], capsys)
    assert status == 1 and json.loads(out) | {"head": None} == {
        "revision": None, "head": None, "state": "empty", "compatible_from": None, "ok": False,
    }  # fmt: skip
    status, out, _ = run(["db", "upgrade", "--json"], capsys)
    state = json.loads(out)
    assert status == 0 and state["ok"] and state["revision"] == state["head"] is not None
