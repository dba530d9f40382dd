"""`atrium db upgrade|current|check`: Alembic migrations against the configured database."""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

from alembic.script import ScriptDirectory

from tenants.database import Database, script_location
from tenants.schema_version import SchemaState, schema_state, upgrade_unless_newer
from web.cli.output import print_json
from web.cli.runner import EXIT_FAILED, database_flag, guarded, settings_of

COMMANDS = (
    (
        "upgrade",
        "apply pending migrations (none on a newer schema this code runs on: a rollback's)",
    ),
    ("current", "show revision"),
    (
        "check",
        "exit 0 when this code runs on the schema (its head, or a newer one that says so), "
        "1 when it is older, empty or of an unknown lineage",
    ),
)


def head_revision() -> str | None:
    """The newest revision this code ships (what `db upgrade` migrates to)."""
    return ScriptDirectory(str(script_location())).get_current_head()


def known_revisions() -> set[str]:
    """Every revision this code ships."""
    return {script.revision for script in ScriptDirectory(str(script_location())).walk_revisions()}


def run_db(args: argparse.Namespace) -> int:
    async def work() -> SchemaState:
        db = await Database.connect(settings_of(args).database_url)
        try:
            if args.db_command == "upgrade":
                return await upgrade_unless_newer(db)
            return await schema_state(db)
        finally:
            await db.close()

    state = guarded(f"db {args.db_command}", lambda: asyncio.run(work()))
    if isinstance(state, int):
        return state
    if args.json:
        print_json(state_fields(state))
        return EXIT_FAILED if args.db_command in ("check", "upgrade") and not state.ok else 0
    if args.db_command in ("check", "upgrade"):
        return check(state)
    print(state.revision or "(empty database)")
    return 0


def state_fields(state: SchemaState) -> dict[str, object]:
    """What ``--json`` prints: the database's revision, this code's head, and how they stand
    (head, newer, older, empty, too_new or unknown; ``ok``: this code runs on it)."""
    return {
        "revision": state.revision,
        "head": state.head,
        "state": state.kind,
        "compatible_from": state.compatible_from,
        "ok": state.ok,
    }


def check(state: SchemaState) -> int:
    """Say whether this code runs on the schema, in one line (a waiting init container prints
    it on every try: no traceback)."""
    at, head, since = state.revision or "an empty database", state.head, state.compatible_from
    if state.kind == "head":
        print(state.revision)
        return 0
    if state.kind == "newer":
        print(f"{at} (newer than this code's {head}; code from {since} on runs on it)")
        return 0
    problem = f"at {at}, the code expects {head}"
    if state.kind == "too_new":
        problem = f"at {at}, newer than this code ({head}) runs on: it needs code from {since} on"
    elif state.kind == "unknown":
        problem = f"at {at}, a revision of no lineage this code ({head}) knows"
    print(f"atrium db check: {problem}", file=sys.stderr)
    return EXIT_FAILED


def register(subparsers: Any) -> None:
    """Add `db` to the `atrium` command line."""
    db = subparsers.add_parser("db", help="database migrations")
    db_commands = db.add_subparsers(dest="db_command", required=True)
    for name, help_text in COMMANDS:
        sub = db_commands.add_parser(name, help=help_text, description=help_text)
        database_flag(sub)
        sub.add_argument(
            "--json", action="store_true", help="print the revision, the head and how they stand"
        )
        sub.set_defaults(func=run_db)
