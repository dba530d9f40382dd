"""The test PostgreSQL: URLs, admin statements, migration, and a reachability check."""

from __future__ import annotations

import asyncio
import os

import asyncpg
import pytest

from tenants import Database

PG_HOST = "127.0.0.1"
PG_PORT = 5432
PG_ADMIN_DSN = f"postgresql://postgres@{PG_HOST}:{PG_PORT}/test"


def pg_url(name: str, port: int = PG_PORT) -> str:
    return f"postgresql+asyncpg://postgres@{PG_HOST}:{port}/{name}"


async def pg_admin(sql: str) -> None:
    """Run one statement on the maintenance database (CREATE/DROP DATABASE)."""
    conn = await asyncpg.connect(PG_ADMIN_DSN, timeout=3)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


async def migrate(url: str) -> None:
    db = await Database.connect(url)
    try:
        await db.upgrade()
    finally:
        await db.close()


def require_postgres() -> None:
    """Skip when the server is unreachable on a developer machine; fail in CI, which has one."""
    try:
        asyncio.run(pg_admin("SELECT 1"))
    except (OSError, asyncpg.PostgresError, TimeoutError) as exc:
        message = f"PostgreSQL at {PG_HOST}:{PG_PORT} is unreachable: {exc}"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
