"""Fixtures: a freshly migrated database per test, on SQLite and on PostgreSQL."""

from __future__ import annotations

import asyncio
import shutil
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from tenants import Database, TenantDomain
from tests.support.postgres import migrate, pg_admin, pg_url, require_postgres


class FakeClock:
    """A settable UTC clock for rate limits and time windows."""

    def __init__(self, start: datetime) -> None:
        self.now = start

    def __call__(self) -> datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(datetime(2031, 3, 10, 12, 0, tzinfo=UTC))


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("sqlite-template") / "template.db"
    asyncio.run(migrate(f"sqlite+aiosqlite:///{path}"))
    return path


@pytest.fixture(scope="session")
def pg_template() -> Iterator[str]:
    require_postgres()
    name = f"atrium_tpl_{uuid.uuid4().hex[:10]}"
    asyncio.run(pg_admin(f"CREATE DATABASE {name}"))
    try:
        asyncio.run(migrate(pg_url(name)))
        yield name
    finally:
        asyncio.run(pg_admin(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A database at the head revision, private to this test."""
    if request.param == "sqlite":
        target = tmp_path / "atrium.db"
        shutil.copyfile(request.getfixturevalue("sqlite_template"), target)
        yield f"sqlite+aiosqlite:///{target}"
        return
    template = request.getfixturevalue("pg_template")
    name = f"atrium_t_{uuid.uuid4().hex[:12]}"
    asyncio.run(pg_admin(f"CREATE DATABASE {name} TEMPLATE {template}"))
    try:
        yield pg_url(name)
    finally:
        asyncio.run(pg_admin(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))


OpenDomain = Callable[..., AbstractAsyncContextManager[TenantDomain]]


@pytest.fixture
def open_domain(db_url: str, tmp_path: Path, clock: FakeClock) -> OpenDomain:
    """``async with open_domain() as domain:`` — services on this test's database."""

    @asynccontextmanager
    async def _open(*, spool: Path | None = None) -> AsyncIterator[TenantDomain]:
        db = await Database.connect(db_url)
        domain = await TenantDomain.open(
            db, spool_path=spool or tmp_path / "usage.spool", clock=clock
        )
        try:
            yield domain
        finally:
            await domain.close()

    return _open


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def empty_db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A database with no tables at all."""
    if request.param == "sqlite":
        yield f"sqlite+aiosqlite:///{tmp_path / 'empty.db'}"
        return
    request.getfixturevalue("pg_template")  # skips when the server is unreachable
    name = f"atrium_e_{uuid.uuid4().hex[:12]}"
    asyncio.run(pg_admin(f"CREATE DATABASE {name}"))
    try:
        yield pg_url(name)
    finally:
        asyncio.run(pg_admin(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
