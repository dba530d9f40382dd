"""`atrium db upgrade|current`, `atrium tenants create`, `atrium keys create`: admin commands.

Each command prints JSON (or the revision) on stdout and returns a process exit status.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import msgspec

from tenants.auth_cache import AuthCache
from tenants.database import Database
from tenants.errors import TenantError
from tenants.key_service import KeyService
from tenants.schemas import TenantCreate
from tenants.server_secrets import load_key_secret
from tenants.tenant_service import TenantService
from web.settings import Settings, SettingsError

T = TypeVar("T")
CLI_ACTOR = "cli"


def _settings(args: argparse.Namespace) -> Settings:
    return Settings.load({"database_url": getattr(args, "database_url", None)})


def _key_secret(settings: Settings) -> bytes | None:
    # The same secret the gateway hashes keys with, or the one stored in the database.
    return settings.server_secret.encode("utf-8") if settings.server_secret else None


async def _with_db(settings: Settings, work: Callable[[Database], Awaitable[T]]) -> T:
    db = await Database.connect(settings.database_url)
    try:
        if db.dialect == "sqlite":  # the embedded default migrates itself, as `serve` does
            await db.upgrade()
        return await work(db)
    finally:
        await db.close()


def _run(name: str, args: argparse.Namespace, work: Callable[[Database], Awaitable[T]]) -> T | int:
    try:
        return asyncio.run(_with_db(_settings(args), work))
    except (SettingsError, TenantError, ValueError) as exc:
        print(f"atrium {name}: {exc}", file=sys.stderr)
        return 2


def _print_json(value: Any) -> int:
    sys.stdout.write(msgspec.json.encode(value).decode("utf-8") + "\n")
    return 0


def run_db(args: argparse.Namespace) -> int:
    async def work() -> str | None:
        db = await Database.connect(_settings(args).database_url)
        try:
            if args.db_command == "upgrade":
                await db.upgrade()
            return await db.current()
        finally:
            await db.close()

    try:
        revision = asyncio.run(work())
    except (SettingsError, TenantError, ValueError) as exc:
        print(f"atrium db: {exc}", file=sys.stderr)
        return 2
    print(revision or "(empty database)")
    return 0


def run_tenants_create(args: argparse.Namespace) -> int:
    async def work(db: Database) -> Any:
        spec = msgspec.convert({"name": args.name, "weight": args.weight}, TenantCreate)
        return await TenantService(db).create(spec, actor=CLI_ACTOR)

    result = _run("tenants create", args, work)
    return result if isinstance(result, int) else _print_json(result)


def run_keys_create(args: argparse.Namespace) -> int:
    async def work(db: Database) -> Any:
        secret = await load_key_secret(db, _key_secret(_settings(args)))
        keys = KeyService(db, secret, AuthCache())
        info, key = await keys.create_key(args.tenant_id, args.name, actor=CLI_ACTOR)
        return {"id": info.id, "key": key, "tenant_id": info.tenant_id, "name": info.name}

    result = _run("keys create", args, work)
    return result if isinstance(result, int) else _print_json(result)


def _database_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--database-url", dest="database_url", default=None)


def register(subparsers: Any) -> None:
    """Add `db`, `tenants` and `keys` to the `atrium` command line."""
    db = subparsers.add_parser("db", help="database migrations")
    db_commands = db.add_subparsers(dest="db_command", required=True)
    for name, help_text in (("upgrade", "apply pending migrations"), ("current", "show revision")):
        sub = db_commands.add_parser(name, help=help_text)
        _database_flag(sub)
        sub.set_defaults(func=run_db)

    tenants = subparsers.add_parser("tenants", help="manage tenants")
    tenant_commands = tenants.add_subparsers(dest="tenants_command", required=True)
    create = tenant_commands.add_parser("create", help="create a tenant and print it as JSON")
    create.add_argument("name")
    create.add_argument("--weight", type=float, default=1.0)
    _database_flag(create)
    create.set_defaults(func=run_tenants_create)

    keys = subparsers.add_parser("keys", help="manage API keys")
    key_commands = keys.add_subparsers(dest="keys_command", required=True)
    issue = key_commands.add_parser("create", help="issue a key; it is printed this once only")
    issue.add_argument("tenant_id")
    issue.add_argument("--name", default="default")
    _database_flag(issue)
    issue.set_defaults(func=run_keys_create)
