"""`atrium db upgrade|current|check`: Alembic migrations against the configured database."""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

from alembic.script import ScriptDirectory

from tenants.database import Database, script_location
from web.cli.runner import EXIT_FAILED, database_flag, guarded, settings_of

COMMANDS = (
    ("upgrade", "apply pending migrations"),
    ("current", "show revision"),
    ("check", "exit 0 when the database is at the newest revision, 1 when it is not"),
)


def head_revision() -> str | None:
    """The newest revision this code ships (what `db upgrade` migrates to)."""
    return ScriptDirectory(str(script_location())).get_current_head()


def known_revisions() -> set[str]:
    """Every revision this code ships."""
    return {script.revision for script in ScriptDirectory(str(script_location())).walk_revisions()}


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
    if args.db_command == "check":
        head = head_revision()
        if revision != head:
            # A waiting init container prints this on every try: one line, no traceback.
            shown = revision or "an empty database"
            print(f"atrium db check: at {shown}, the code expects {head}", file=sys.stderr)
            return EXIT_FAILED
    print(revision or "(empty database)")
    return 0


def register(subparsers: Any) -> None:
    """Add `db` to the `atrium` command line."""
    db = subparsers.add_parser("db", help="database migrations")
    db_commands = db.add_subparsers(dest="db_command", required=True)
    for name, help_text in COMMANDS:
        sub = db_commands.add_parser(name, help=help_text)
        database_flag(sub)
        sub.set_defaults(func=run_db)
