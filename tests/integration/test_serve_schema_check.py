"""`atrium serve` on PostgreSQL refuses an empty or older schema with one line, and starts as
before on a current one, on one newer code migrated, or on a database it cannot reach yet."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator

import pytest
from sqlalchemy import text

from tenants.database import Database
from tests.support.postgres import pg_admin, pg_url, require_postgres
from web.cli import main
from web.cli.db_commands import head_revision, known_revisions
from web.cli.serve import schema_problem
from web.settings import Settings

NAME = f"atrium_schema_check_{os.getpid()}"


@pytest.fixture
def empty_pg() -> Iterator[str]:
    require_postgres()
    asyncio.run(pg_admin(f"DROP DATABASE IF EXISTS {NAME}"))
    asyncio.run(pg_admin(f"CREATE DATABASE {NAME}"))
    yield pg_url(NAME)
    asyncio.run(pg_admin(f"DROP DATABASE IF EXISTS {NAME} WITH (FORCE)"))


def _settings(url: str) -> Settings:
    return Settings.load({"database_url": url}, environ={})


async def _migrate(url: str, revision: str = "head") -> None:
    db = await Database.connect(url)
    try:
        await db.upgrade(revision)
    finally:
        await db.close()


def test_serve_refuses_an_empty_database_in_one_line(
    empty_pg: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ATRIUM_DATABASE_URL", empty_pg)
    status = main(["serve", "--port", "0"])  # refused before any model loads or port opens
    err = capsys.readouterr().err
    assert status == 1
    assert "tenant database is empty" in err and "atrium db upgrade" in err
    assert "Traceback" not in err


def test_serve_refuses_an_older_schema_and_accepts_the_current_one(empty_pg: str) -> None:
    older = sorted(known_revisions() - {head_revision()})[-1]
    asyncio.run(_migrate(empty_pg, older))
    problem = schema_problem(_settings(empty_pg))
    assert problem is not None and f"at revision {older}" in problem
    asyncio.run(_migrate(empty_pg))
    assert schema_problem(_settings(empty_pg)) is None


def test_serve_starts_on_a_newer_schema_and_on_an_unreachable_database(empty_pg: str) -> None:
    asyncio.run(_migrate(empty_pg))

    async def stamp_newer() -> None:  # as a newer release's migration would leave it
        db = await Database.connect(empty_pg)
        try:
            async with db.engine.begin() as conn:
                await conn.execute(text("UPDATE alembic_version SET version_num = 'zz_newer'"))
        finally:
            await db.close()

    asyncio.run(stamp_newer())
    assert schema_problem(_settings(empty_pg)) is None
    assert schema_problem(_settings(pg_url("nowhere", port=1))) is None
    # SQLite and the engine role are not checked: SQLite is migrated at start.
    assert schema_problem(_settings("sqlite+aiosqlite:///:memory:")) is None
