"""The admin commands through `atrium`'s entry point, on SQLite and PostgreSQL: what they print,
what they change (audited as ``cli``), and one-line errors with a non-zero exit."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from tenants.auth_cache import AuthCache
from tenants.database import Database
from tenants.key_service import KeyService
from tenants.records import UsageEvent
from tenants.server_secrets import load_key_secret
from tenants.usage_store import UsageStore
from tests.support.postgres import migrate, pg_admin, pg_url, require_postgres
from web.cli import main


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def url(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[str]:
    monkeypatch.delenv("ATRIUM_SERVER_SECRET", raising=False)
    if request.param == "sqlite":
        value = f"sqlite+aiosqlite:///{tmp_path / 'cli.db'}"
        monkeypatch.setenv("ATRIUM_DATABASE_URL", value)
        yield value
        return
    require_postgres()
    name = f"atrium_cli_{uuid.uuid4().hex[:12]}"
    asyncio.run(pg_admin(f"CREATE DATABASE {name}"))
    try:
        asyncio.run(migrate(pg_url(name)))  # PostgreSQL is migrated by `atrium db upgrade`
        monkeypatch.setenv("ATRIUM_DATABASE_URL", pg_url(name))
        yield pg_url(name)
    finally:
        asyncio.run(pg_admin(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))


class Cli:
    def __init__(self, capsys: pytest.CaptureFixture[str]) -> None:
        self.capsys = capsys

    def __call__(self, *argv: str, status: int = 0) -> str:
        code = main(list(argv))
        out, err = self.capsys.readouterr()
        assert code == status, err
        if status:
            assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
            return err
        return out

    def json(self, *argv: str) -> Any:
        return json.loads(self(*argv, "--json"))


@pytest.fixture
def cli(url: str, capsys: pytest.CaptureFixture[str]) -> Cli:
    return Cli(capsys)


def _authenticate(url: str, secret: str) -> str:
    async def run() -> str:
        db = await Database.connect(url)
        try:
            keys = KeyService(db, await load_key_secret(db), AuthCache())
            return (await keys.authenticate(secret)).key_id
        finally:
            await db.close()

    return asyncio.run(run())


def test_tenants_are_listed_changed_suspended_and_deleted(cli: Cli) -> None:
    tenant = json.loads(cli("tenants", "create", "acme"))
    json.loads(cli("tenants", "create", "beta"))
    assert [t["name"] for t in cli.json("tenants", "list")] == ["acme", "beta"]
    assert cli.json("tenants", "show", tenant["id"]) == tenant
    changed = cli.json(
        "tenants", "update", tenant["id"], "--weight", "2", "--rpm", "60", "--kv-cache-share", "0.5"
    )
    assert changed["weight"] == 2.0 and changed["quotas"]["requests_per_minute"] == 60
    assert changed["quotas"]["kv_cache_share"] == 0.5
    cleared = cli.json("tenants", "update", tenant["id"], "--rpm", "none")
    assert cleared["quotas"]["requests_per_minute"] is None
    money = cli.json("tenants", "update", tenant["id"], "--monthly-cost-budget", "25000000")
    assert money["quotas"]["monthly_cost_budget"] == 25_000_000
    models = cli.json("tenants", "update", tenant["id"], "--models", "small, big")
    assert models["quotas"]["models"] == ["small", "big"]
    assert (
        cli.json("tenants", "update", tenant["id"], "--models", "all")["quotas"]["models"] is None
    )
    assert "models" in cli("tenants", "update", tenant["id"], "--models", "a,a", status=2)
    assert cleared["quotas"]["kv_cache_share"] == 0.5  # untouched
    assert cli.json("tenants", "suspend", tenant["id"])["status"] == "suspended"
    assert cli.json("tenants", "resume", tenant["id"])["status"] == "active"
    assert cli.json("tenants", "delete", tenant["id"])["status"] == "deleted"
    assert [t["name"] for t in cli.json("tenants", "list")] == ["beta"]
    assert len(cli.json("tenants", "list", "--all")) == 2
    table = cli("tenants", "list", "--table")
    assert "name" in table and "beta" in table and "{" not in table
    err = cli("tenants", "show", tenant["id"], status=2)
    assert err.startswith("atrium tenants show:") and "not found" in err
    assert "nothing to change" in cli("tenants", "update", "tn_x", status=2)


def test_key_lifecycle_from_the_command_line(cli: Cli, url: str) -> None:
    tenant_id = json.loads(cli("tenants", "create", "acme"))["id"]
    issued = json.loads(
        cli(
            "keys",
            "create",
            tenant_id,
            "--name",
            "ci",
            "--scopes",
            "inference",
            "--models",
            "tiny,small",
            "--rpm",
            "30",
            "--expires-in",
            "30d",
        )
    )
    assert set(issued) == {"id", "key", "tenant_id", "name"}  # as before: CONTRACT §1
    [listed] = cli.json("keys", "list", tenant_id)
    assert (listed["scopes"], listed["models"], listed["requests_per_minute"]) == (
        ["inference"],
        ["tiny", "small"],
        30,
    )
    expires = datetime.fromisoformat(listed["expires_at"])
    assert 29 <= (expires - datetime.now(UTC)).days < 30 and "key" not in listed

    changed = cli.json(
        "keys", "update", issued["id"], "--no-expiry", "--all-models", "--rpm", "none"
    )
    assert changed["expires_at"] is None and changed["models"] is None
    assert changed["requests_per_minute"] is None and changed["scopes"] == ["inference"]

    rotated = json.loads(cli("keys", "rotate", issued["id"], "--overlap", "1h"))
    assert rotated["replaces"] == issued["id"] and rotated["key"] != issued["key"]
    assert _authenticate(url, issued["key"]) == issued["id"]  # still inside the overlap
    assert _authenticate(url, rotated["key"]) == rotated["id"]
    assert cli.json("keys", "show", issued["id"])["replaced_by"] == rotated["id"]
    assert "rotated" in cli("keys", "rotate", issued["id"], status=2)

    assert cli.json("keys", "revoke", rotated["id"])["revoked_at"] is not None
    actions = [
        (e["action"], e["target"], e["actor"]) for e in cli.json("audit", "--action", "key.")
    ]
    assert actions == [
        ("key.create", issued["id"], "cli"),
        ("key.update", issued["id"], "cli"),
        ("key.create", rotated["id"], "cli"),
        ("key.rotate", issued["id"], "cli"),
        ("key.revoke", rotated["id"], "cli"),
    ]
    assert "Invalid enum value 'admin'" in cli(
        "keys", "create", tenant_id, "--scopes", "admin", status=2
    )


def test_prices_usage_and_billing_export(cli: Cli, url: str, tmp_path: Path) -> None:
    tenant_id = json.loads(cli("tenants", "create", "acme"))["id"]
    price = cli.json(
        "prices", "set", "tiny", "--input-price", "1000000", "--cached-input-price", "0",
        "--output-price", "2000000", "--effective-from", "2031-01-01T00:00:00Z",
        "--batch-discount", "50",
    )  # fmt: skip
    assert price["model"] == "tiny" and price["currency"] == "USD"
    assert price["batch_discount_percent"] == 50
    assert [p["model"] for p in cli.json("prices", "list")] == ["tiny"]
    at = datetime(2031, 3, 4, 9, tzinfo=UTC)
    event = UsageEvent(
        request_id="r1", tenant_id=tenant_id, key_id=None, model="tiny", prompt_tokens=1000,
        cached_tokens=0, completion_tokens=500, status="ok", started_at=at, finished_at=at,
    )  # fmt: skip

    async def write() -> None:
        db = await Database.connect(url)
        try:
            await UsageStore(db).write([event])
        finally:
            await db.close()

    asyncio.run(write())
    window = ["--start", "2031-03-01", "--end", "2031-04-01"]
    [bucket] = cli.json("usage", "--tenant", tenant_id, *window)
    assert (bucket["requests"], bucket["prompt_tokens"], bucket["completion_tokens"]) == (
        1,
        1000,
        500,
    )
    rows = list(csv_rows(cli("billing", "export", *window)))
    assert rows[0]["tenant_name"] == "acme" and rows[0]["cost"] == "0.002000"
    out = tmp_path / "bill.jsonl"
    manifest = cli.json("billing", "export", *window, "--format", "jsonl", "--output", str(out))
    assert manifest["rows"] == 1 and json.loads(out.read_text())["requests"] == 1


def csv_rows(text: str) -> Iterator[dict[str, str]]:
    import csv
    import io

    yield from csv.DictReader(io.StringIO(text))


def test_failures_are_one_line_with_a_status(cli: Cli, tmp_path: Path) -> None:
    unreachable = "postgresql+asyncpg://nobody@127.0.0.1:9/none"
    err = cli("tenants", "list", "--database-url", unreachable, status=1)
    assert err.startswith("atrium tenants list: database error")
    with pytest.raises(SystemExit) as usage:
        main(["keys", "rotate", "key_x", "--overlap", "soon"])
    assert usage.value.code == 2


def test_public_prefixes_publish_list_unpublish(cli: Cli, tmp_path: Path, url: str) -> None:
    rules = cli.json("public-prefixes", "publish", "You are a careful assistant.")
    assert rules["id"].startswith("pp_") and rules["created_by"] == "cli"
    source = tmp_path / "style.txt"
    source.write_text("Answer in French.\nKeep it short.", encoding="utf-8")
    style = cli.json("public-prefixes", "publish", "--file", str(source))
    assert style["text"] == "Answer in French.\nKeep it short."
    assert [p["id"] for p in cli.json("public-prefixes", "list")] == [rules["id"], style["id"]]
    table = cli("public-prefixes", "list", "--table")  # 80 columns: ids whole, text wraps
    assert rules["id"] in table and style["id"] in table
    table = cli("public-prefixes", "list", "--table", "--wide")  # each row on one line
    assert rules["id"] in table and "Answer in French. Keep it short." in table

    gone = cli.json("public-prefixes", "unpublish", rules["id"])
    assert gone["unpublished_by"] == "cli" and gone["unpublished_at"]
    assert [p["id"] for p in cli.json("public-prefixes", "list")] == [style["id"]]
    assert len(cli.json("public-prefixes", "list", "--all")) == 2
    audit = [(a["action"], a["actor"]) for a in cli.json("audit", "--action", "public_prefix.")]
    assert audit.count(("public_prefix.publish", "cli")) == 2
    assert ("public_prefix.unpublish", "cli") in audit

    err = cli("public-prefixes", "publish", "Answer in French.\nKeep it short.", status=2)
    assert "already published" in err
    assert "already unpublished" in cli("public-prefixes", "unpublish", rules["id"], status=2)
    assert "no public prefix" in cli("public-prefixes", "unpublish", "pp_nope", status=2)
    assert "must not be empty" in cli("public-prefixes", "publish", "  ", status=2)
    assert "not both" in cli("public-prefixes", "publish", "x", "--file", str(source), status=2)
    missing = tmp_path / "missing.txt"
    assert "cannot read" in cli("public-prefixes", "publish", "--file", str(missing), status=2)


def test_lora_adapters_register_list_remove(cli: Cli) -> None:
    acme = cli.json("tenants", "create", "acme")
    big = cli.json(
        "lora-adapters", "register", "big-tone", "/srv/adapters/big", "--tenant", "acme",
        "--base-model", "big",
    )  # fmt: skip
    assert (big["tenant_id"], big["base_model"], big["created_by"]) == (acme["id"], "big", "cli")
    shared = cli.json("lora-adapters", "register", "style", "/srv/adapters/style")
    assert (shared["tenant_id"], shared["base_model"]) == (None, None)
    listed = cli.json("lora-adapters", "list")
    assert [(a["name"], a["base_model"]) for a in listed] == [("big-tone", "big"), ("style", None)]
    assert [a["name"] for a in cli.json("lora-adapters", "list", "--tenant", "acme")] == [
        "big-tone",
        "style",
    ]
    table = cli("lora-adapters", "list", "--table")
    assert big["id"] in table and "big" in table
    gone = cli.json("lora-adapters", "remove", big["id"])
    assert gone["id"] == big["id"]
    assert [a["name"] for a in cli.json("lora-adapters", "list")] == ["style"]
    audit = [(a["action"], a["actor"]) for a in cli.json("audit", "--action", "lora_adapter.")]
    assert audit == [("lora_adapter.register", "cli")] * 2 + [("lora_adapter.remove", "cli")]

    taken = cli("lora-adapters", "register", "style", "/srv/adapters/other", status=2)
    assert "already exists" in taken
    assert "absolute" in cli("lora-adapters", "register", "x", "relative/dir", status=2)
    assert "base_model" in cli(
        "lora-adapters", "register", "x", "/srv/x", "--base-model", "", status=2
    )
    assert "no adapter" in cli("lora-adapters", "remove", big["id"], status=2)


def test_the_installed_entry_point_prints_json_off_a_terminal(url: str) -> None:
    env = {**os.environ, "ATRIUM_DATABASE_URL": url}
    command = [sys.executable, "-m", "web.cli"]
    created = subprocess.run(
        [*command, "tenants", "create", "acme"], env=env, capture_output=True, text=True, check=True
    )
    listed = subprocess.run(
        [*command, "tenants", "list"], env=env, capture_output=True, text=True, check=True
    )
    assert json.loads(listed.stdout) == [json.loads(created.stdout)]
    missing = subprocess.run(
        [*command, "keys", "list", "tn_missing"],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert missing.returncode == 2 and missing.stdout == ""
    assert missing.stderr.strip() == "atrium keys list: tenant 'tn_missing' not found"
