"""Async engine and sessions for SQLite (aiosqlite, WAL) and PostgreSQL (asyncpg), plus migrations.

Alembic's scripts live in the top-level ``migrations`` package, found by location only; timeouts
are short so an unreachable server fails calls fast (``is_unavailable`` tells those failures apart).
"""

from __future__ import annotations

import asyncio
import importlib.util
import re
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, event, exc, text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import (
    AsyncEngine,
    AsyncSession,
    async_sessionmaker,
    create_async_engine,
)
from sqlalchemy.pool import ConnectionPoolEntry

from tenants.errors import InvalidInputError, MigrationError

if TYPE_CHECKING:
    from alembic.config import Config

SQLITE_BUSY_TIMEOUT_MS = 10_000
SQLITE_PROBE_BUSY_TIMEOUT_MS = 1_000
CONNECT_TIMEOUT_S = 3.0  # opening a PostgreSQL connection
COMMAND_TIMEOUT_S = 10.0  # one PostgreSQL statement
POOL_TIMEOUT_S = 5.0  # waiting for a pooled connection
SQLITE_POOL_TIMEOUT_S = 30.0  # waiting for SQLite's one connection (a queue, not a failure)
# SQLSTATE classes of a server that cannot serve: connection exceptions, insufficient resources,
# operator intervention (shutting down, starting up).
UNAVAILABLE_SQLSTATES = ("08", "53", "57P")
# SQLite reports both I/O trouble and schema mistakes as OperationalError; these are mistakes.
SQLITE_LOGIC_ERRORS = ("no such ", "syntax error", "has no column")


def is_unavailable(error: BaseException) -> bool:
    """Whether ``error`` (or what caused it) means the database could not be reached in time:
    refused or lost connections, timeouts, a server going away. Logic errors are not."""
    current: BaseException | None = error
    for _ in range(8):  # a cause chain is short; guard against cycles
        if current is None:
            return False
        if isinstance(current, exc.DBAPIError) and current.connection_invalidated:
            return True
        sqlstate = getattr(current, "sqlstate", None) or getattr(current, "pgcode", None)
        if isinstance(sqlstate, str) and sqlstate.startswith(UNAVAILABLE_SQLSTATES):
            return True
        if isinstance(current, exc.OperationalError):
            message = str(current.orig).lower()
            return not any(marker in message for marker in SQLITE_LOGIC_ERRORS)
        if isinstance(current, exc.TimeoutError):
            return False  # the pool is exhausted: this process is busy, the server may be fine
        if isinstance(
            current, exc.InterfaceError | exc.DisconnectionError | OSError | TimeoutError
        ):
            return True
        current = current.__cause__
    return False


def script_location() -> Path:
    """The Alembic scripts folder, from the repository or an installed package."""
    spec = importlib.util.find_spec("migrations")
    if spec is None or spec.origin is None:
        raise MigrationError("the migrations package is not installed")
    folder = Path(spec.origin).resolve().parent
    if not (folder / "env.py").is_file():
        raise MigrationError(f"no Alembic env.py in {folder}")
    return folder


_RECORDED_REVISION = "SELECT version_num FROM alembic_version"
# A migration script's ``revision = "…"`` and ``down_revision = "…" | None`` lines.
_SCRIPT_REVISION = re.compile(r'^(down_)?revision\b[^=\n]*=\s*(?:"([^"]+)"|None)\s*$', re.M)


def shipped_head() -> str | None:
    """This code's newest migration revision, read from the scripts' text without importing
    Alembic; None when the scripts do not form one line (the caller then asks Alembic)."""
    revisions: set[str] = set()
    parents: set[str] = set()
    for path in (script_location() / "versions").glob("*.py"):
        found = {bool(m[1]): m[2] for m in _SCRIPT_REVISION.finditer(path.read_text("utf-8"))}
        if not found.get(False) or True not in found:
            return None  # a script this reading does not understand
        revisions.add(found[False])
        if found[True] is not None:
            parents.add(found[True])
    heads = revisions - parents
    return heads.pop() if len(heads) == 1 and len(revisions) == len(parents) + 1 else None


def _sqlite_on_connect(dbapi_connection: Any, _record: ConnectionPoolEntry) -> None:
    # Let SQLAlchemy emit BEGIN itself (below) instead of the driver's implicit deferred one.
    dbapi_connection.isolation_level = None
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.close()


def _sqlite_probe_on_connect(dbapi_connection: Any, _record: ConnectionPoolEntry) -> None:
    # Autocommit and no BEGIN listener: a probe's read never asks for the write lock, and in
    # WAL mode it does not wait for writers either.
    dbapi_connection.isolation_level = None
    cursor = dbapi_connection.cursor()
    cursor.execute(f"PRAGMA busy_timeout={SQLITE_PROBE_BUSY_TIMEOUT_MS}")
    cursor.close()


def _sqlite_on_begin(conn: Connection) -> None:
    # IMMEDIATE takes the write lock up front, so a read-then-write transaction waits on the
    # busy timeout instead of failing with SQLITE_BUSY when it upgrades its lock.
    conn.exec_driver_sql("BEGIN IMMEDIATE")


# PostgreSQL connections kept open (as many more may be opened for a burst).
DEFAULT_POOL_SIZE = 10


class Database:
    """One engine and its session factory; create with ``await Database.connect(url)``."""

    def __init__(self, engine: AsyncEngine, probe_engine: AsyncEngine | None = None) -> None:
        self.engine = engine
        self.sessions = async_sessionmaker(engine, expire_on_commit=False)
        # Health probes use a connection of their own, so they never queue behind the pool's
        # transactions (SQLite's one connection, a busy PostgreSQL pool) nor take a lock.
        self._probe_engine = probe_engine

    @classmethod
    async def connect(
        cls,
        url: str,
        *,
        pool_size: int = DEFAULT_POOL_SIZE,
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
        command_timeout_s: float = COMMAND_TIMEOUT_S,
    ) -> Database:
        parsed = make_url(url)
        if parsed.drivername == "sqlite+aiosqlite":
            # One connection: every transaction takes SQLite's write lock up front (see
            # _sqlite_on_begin), so more connections would only queue on the lock through
            # SQLite's busy handler, which sleeps between retries; the pool's queue hands
            # the connection on as soon as it is returned, in arrival order.
            engine = create_async_engine(
                url, pool_size=1, max_overflow=0, pool_timeout=SQLITE_POOL_TIMEOUT_S
            )
            event.listen(engine.sync_engine, "connect", _sqlite_on_connect)
            event.listen(engine.sync_engine, "begin", _sqlite_on_begin)
            probe = create_async_engine(url, pool_size=1, max_overflow=0)
            event.listen(probe.sync_engine, "connect", _sqlite_probe_on_connect)
        elif parsed.drivername == "postgresql+asyncpg":
            engine = create_async_engine(
                url,
                pool_size=pool_size,
                max_overflow=pool_size,
                pool_pre_ping=True,
                pool_timeout=POOL_TIMEOUT_S,
                connect_args={"timeout": connect_timeout_s, "command_timeout": command_timeout_s},
            )
            probe = create_async_engine(
                url,
                pool_size=1,
                max_overflow=0,
                connect_args={"timeout": connect_timeout_s, "command_timeout": command_timeout_s},
            )
        else:
            raise InvalidInputError(
                "database URL must use sqlite+aiosqlite:// or postgresql+asyncpg://",
                "database_url",
            )
        return cls(engine, probe)

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    async def close(self) -> None:
        if self._probe_engine is not None:
            await self._probe_engine.dispose()
        await self.engine.dispose()

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[AsyncSession]:
        """A session inside one transaction: committed on success, rolled back on error."""
        async with self.sessions() as session, session.begin():
            yield session

    async def ping(self, timeout_s: float | None = None) -> bool:
        """True when a pooled connection answers a trivial query within ``timeout_s`` (this also
        opens the pool's connections; on SQLite it waits for the write lock like any call)."""
        try:
            async with asyncio.timeout(timeout_s), self.engine.connect() as conn:
                await conn.execute(text("SELECT 1"))
        except Exception:
            return False
        return True

    async def probe(self, timeout_s: float | None = None) -> bool:
        """Health: True when the database answers a read within ``timeout_s``, on a connection
        of its own and without any lock (SQLite reads its schema page, so the file is read)."""
        engine = self._probe_engine or self.engine
        query = "SELECT count(*) FROM sqlite_master" if self.dialect == "sqlite" else "SELECT 1"
        try:
            async with asyncio.timeout(timeout_s), engine.connect() as conn:
                await conn.execute(text(query))
                await conn.rollback()
        except Exception:
            return False
        return True

    async def upgrade(self, revision: str = "head") -> None:
        from alembic import command

        await self._run_alembic(lambda cfg: command.upgrade(cfg, revision))

    async def upgrade_unless_at_head(self) -> None:
        """``upgrade()``, unless a plain query finds the schema at this code's head already
        (then Alembic is not even imported: a SQL-only command starts faster)."""
        head = shipped_head()
        if head is None or await self.recorded_revision() != head:
            await self.upgrade()

    async def downgrade(self, revision: str) -> None:
        from alembic import command

        await self._run_alembic(lambda cfg: command.downgrade(cfg, revision))

    async def current(self) -> str | None:
        """The applied revision, or None on an empty database."""
        from alembic.runtime.migration import MigrationContext

        async with self.engine.connect() as conn:
            return await conn.run_sync(
                lambda sync: MigrationContext.configure(sync).get_current_revision()
            )

    async def recorded_revision(self) -> str | None:
        """The one revision the ``alembic_version`` table records, by a plain query; None
        when there is no such table or it does not hold exactly one row."""
        try:
            async with self.engine.connect() as conn:
                rows = (await conn.execute(text(_RECORDED_REVISION))).all()
        except exc.DBAPIError:
            return None
        return str(rows[0][0]) if len(rows) == 1 else None

    async def _run_alembic(self, action: Callable[[Config], None]) -> None:
        from alembic.config import Config

        folder = script_location()
        cfg = Config()
        cfg.set_main_option("script_location", str(folder))
        async with self.engine.begin() as conn:
            await conn.run_sync(_with_connection, cfg, action)


def _with_connection(sync: Connection, cfg: Config, action: Callable[[Config], None]) -> None:
    cfg.attributes["connection"] = sync
    action(cfg)
