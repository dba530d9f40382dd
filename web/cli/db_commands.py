"""`atrium db upgrade|current`: Alembic migrations against the configured database."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from tenants.database import Database
from web.cli.runner import database_flag, guarded, settings_of


def run_db(args: argparse.Namespace) -> int:
    async def work() -> str | None:
        db = await Database.connect(settings_of(args).database_url)
        try:
            if args.db_command == "upgrade":
                await db.upgrade()
            return await db.current()
        finally:
            await db.close()

    revision = guarded("db", lambda: asyncio.run(work()))
    if isinstance(revision, int):
        return revision
    print(revision or "(empty database)")
    return 0


def register(subparsers: Any) -> None:
    """Add `db` to the `atrium` command line."""
    db = subparsers.add_parser("db", help="database migrations")
    db_commands = db.add_subparsers(dest="db_command", required=True)
    for name, help_text in (("upgrade", "apply pending migrations"), ("current", "show revision")):
        sub = db_commands.add_parser(name, help=help_text)
        database_flag(sub)
        sub.set_defaults(func=run_db)
