"""Alembic environment: runs on a connection handed in by ``tenants.Database`` or on a URL.

A URL comes from ``sqlalchemy.url`` or ``ATRIUM_DATABASE_URL`` (async drivers are supported).
"""

from __future__ import annotations

import asyncio
import os

from alembic import context
from sqlalchemy import Connection
from sqlalchemy.ext.asyncio import create_async_engine

from tenants.models import Base
from tenants.schema_version import record_compatibility

TARGET = Base.metadata


def _run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=TARGET,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()
        # How far back code may run on the schema now (`atrium db check` reads it).
        revision = context.get_context().get_current_revision()
        record_compatibility(connection, context.script, revision)


async def _run_on_url(url: str) -> None:
    engine = create_async_engine(url)
    try:
        async with engine.begin() as conn:
            await conn.run_sync(_run)
    finally:
        await engine.dispose()


def main() -> None:
    if context.is_offline_mode():
        raise RuntimeError("offline (SQL script) migrations are not supported")
    connection = context.config.attributes.get("connection")
    if isinstance(connection, Connection):
        _run(connection)
        return
    url = context.config.get_main_option("sqlalchemy.url") or os.environ.get(
        "ATRIUM_DATABASE_URL", "sqlite+aiosqlite:///./atrium.db"
    )
    asyncio.run(_run_on_url(url))


main()
