"""Migrations: upgrade from empty, downgrade to nothing, the append-only triggers, and the
adapters' base model (0013) over rows the previous release wrote."""

from __future__ import annotations

import asyncio

import pytest
from alembic.script import ScriptDirectory
from sqlalchemy import inspect, text
from sqlalchemy.exc import DBAPIError

from migrations import alembic_config
from tenants import Database
from tenants.database import shipped_head
from tenants.lora_adapters import LoraAdapterService

TABLES = {
    "tenants",
    "api_keys",
    "usage_events",
    "usage_rollups",
    "token_budgets",
    "reservations",
    "rate_buckets",
    "prices",
    "audit_log",
    "settings",
    "console_sessions",
    "key_rate_buckets",
    "gateway_leases",
    "public_prefixes",
    "batch_files",
    "batches",
    "batch_lines",
    "lora_adapters",
    "auth_failures",
}


def _head(url: str) -> str | None:
    """The newest revision of the project's migration scripts."""
    return ScriptDirectory.from_config(alembic_config(url)).get_current_head()


async def _tables(db: Database) -> set[str]:
    async with db.engine.connect() as conn:
        names = await conn.run_sync(lambda sync: inspect(sync).get_table_names())
    return set(names) - {"alembic_version"}


async def _round_trip(url: str) -> None:
    db = await Database.connect(url)
    try:
        assert await db.current() is None
        assert await db.recorded_revision() is None  # no alembic_version table yet
        assert await _tables(db) == set()
        await db.upgrade()
        assert await db.current() == _head(url)
        assert await _tables(db) == TABLES
        await db.downgrade("base")
        assert await db.current() is None
        assert await _tables(db) == set()
        await db.upgrade()
        assert await _tables(db) == TABLES
        assert await db.ping()
        # The plain query reads what Alembic reads; a schema behind head is migrated as before.
        assert shipped_head() == _head(url)
        assert await db.recorded_revision() == await db.current() == _head(url)
        await db.downgrade("-1")
        behind = await db.recorded_revision()
        assert behind is not None and behind != _head(url)
        await db.upgrade_unless_at_head()
        assert await db.recorded_revision() == _head(url)
        await db.upgrade_unless_at_head()  # at head: nothing to do
        assert await _tables(db) == TABLES
    finally:
        await db.close()


def test_upgrade_from_empty_then_downgrade_to_nothing(empty_db_url: str) -> None:
    asyncio.run(_round_trip(empty_db_url))


def test_audit_rows_and_usage_events_refuse_update_and_delete(db_url: str) -> None:
    async def body() -> None:
        db = await Database.connect(db_url)
        try:
            async with db.engine.begin() as conn:
                await conn.execute(
                    text(
                        "INSERT INTO audit_log (at, actor, action, target) "
                        "VALUES ('2031-01-01 00:00:00', 'a', 'x', 't')"
                    )
                )
            for sql in ("UPDATE audit_log SET actor = 'b'", "DELETE FROM audit_log"):
                with pytest.raises(DBAPIError, match="append-only"):
                    async with db.engine.begin() as conn:
                        await conn.execute(text(sql))
        finally:
            await db.close()

    asyncio.run(body())


async def _adapter_columns(db: Database) -> set[str]:
    async with db.engine.connect() as conn:
        columns = await conn.run_sync(lambda sync: inspect(sync).get_columns("lora_adapters"))
    return {column["name"] for column in columns}


async def _base_models(db: Database) -> dict[str, str | None]:
    async with db.engine.connect() as conn:
        rows = await conn.execute(text("SELECT name, base_model FROM lora_adapters"))
        return {name: base for name, base in rows}


async def _adapter_base_model_round_trip(url: str) -> None:
    db = await Database.connect(url)
    try:
        await db.upgrade("0012")
        async with db.engine.begin() as conn:  # a row as the previous release writes it
            await conn.execute(
                text(
                    "INSERT INTO lora_adapters (id, name, path, tenant_id, created_at, created_by) "
                    "VALUES ('la_old', 'old-tone', '/srv/old', NULL, '2031-01-01 00:00:00', 'a')"
                )
            )
        await db.upgrade("0013")
        assert "base_model" in await _adapter_columns(db)
        service = LoraAdapterService(db)
        (old,) = await service.list_adapters()
        assert (old.name, old.base_model) == ("old-tone", None)  # the first served model
        await service.register("big-tone", "/srv/big", None, base_model="big")
        assert await _base_models(db) == {"old-tone": None, "big-tone": "big"}
        # The previous release registers on the new schema: its rows name no base model.
        async with db.engine.begin() as conn:
            await conn.execute(
                text(
                    "INSERT INTO lora_adapters (id, name, path, tenant_id, created_at, created_by) "
                    "VALUES ('la_prev', 'prev-tone', '/srv/p', NULL, '2031-01-02 00:00:00', 'a')"
                )
            )
        assert (await _base_models(db))["prev-tone"] is None
        await db.downgrade("0012")
        assert "base_model" not in await _adapter_columns(db)
        async with db.engine.connect() as conn:
            names = {row[0] for row in await conn.execute(text("SELECT name FROM lora_adapters"))}
        assert names == {"old-tone", "big-tone", "prev-tone"}  # rows survive the downgrade
        await db.upgrade()
        assert await _base_models(db) == {"old-tone": None, "big-tone": None, "prev-tone": None}
    finally:
        await db.close()


def test_adapter_base_model_column_upgrades_and_downgrades(empty_db_url: str) -> None:
    asyncio.run(_adapter_base_model_round_trip(empty_db_url))
