"""`atrium keys create|list|show|update|rotate|revoke`, on the database directly.

`create` and `rotate` print the new secret once, as JSON; the others print tables or JSON.
A table shows each key's whole id, which `show`, `update`, `rotate` and `revoke` take.
"""

from __future__ import annotations

import argparse
from datetime import UTC, datetime, timedelta
from typing import Any

import msgspec

from tenants.key_policy import KeyPatch, KeyRotate, KeySpec
from tenants.schemas import SCOPES, KeyInfo
from web.cli.output import (
    Column,
    json_flag,
    output_flags,
    print_json,
    print_one,
    print_rows,
    wants_json,
)
from web.cli.runner import (
    CLI_ACTOR,
    DIRECT_NOTE,
    TENANT_HELP,
    Services,
    database_flag,
    run_db,
)
from web.cli.values import count_or_none, duration, instant, names

KEY_COLUMNS = (
    Column("id", "id", whole=True),
    Column("name", "name"),
    Column("prefix", "prefix", whole=True, wide=True),
    Column("status", "status"),
    Column("scopes", "scopes"),
    Column("models", "models", wide=True),
    Column("requests_per_minute", "rpm", wide=True),
    Column("created_at", "created", wide=True),
    Column("expires_at", "expires"),
    Column("revoked_at", "revoked", wide=True),
    Column("replaced_by", "replaced by", whole=True, wide=True),
    Column("last_used_at", "last used"),
)
DEFAULT_KEY_NAME = "default"
KEY_ID_HELP = "the key's id (key_…), as `keys list` shows it"


def key_status(info: KeyInfo, now: datetime) -> str:
    """revoked, expired, replaced (still working until its expiry) or active."""
    if info.revoked_at is not None:
        return "revoked"
    if info.expires_at is not None and info.expires_at <= now:
        return "expired"
    return "replaced" if info.replaced_by is not None else "active"


def _table_row(info: KeyInfo, now: datetime) -> dict[str, Any]:
    return {**msgspec.structs.asdict(info), "status": key_status(info, now)}


def _expiry(args: argparse.Namespace) -> datetime | None:
    expires_in = getattr(args, "expires_in", None)
    if isinstance(expires_in, timedelta):
        return datetime.now(UTC) + expires_in
    expires_at = getattr(args, "expires_at", None)
    return expires_at if isinstance(expires_at, datetime) else None


def run_create(args: argparse.Namespace) -> int:
    async def work(svc: Services) -> dict[str, Any]:
        fields = {
            "name": args.name,
            "expires_at": _expiry(args),
            "scopes": args.scopes or list(SCOPES),
            "models": args.models,
            "requests_per_minute": args.rpm,
        }
        spec = msgspec.convert(fields, KeySpec)  # checks the scope names too
        tenant_id = await svc.tenants.resolve(args.tenant)
        info, key = await svc.keys.create_key(tenant_id, spec, actor=CLI_ACTOR)
        return {"id": info.id, "key": key, "tenant_id": info.tenant_id, "name": info.name}

    result = run_db("keys create", args, work)
    return result if isinstance(result, int) else print_json(result)  # always JSON (CONTRACT)


def run_list(args: argparse.Namespace) -> int:
    async def work(svc: Services) -> list[KeyInfo]:
        return await svc.keys.list_keys(await svc.tenants.resolve(args.tenant))

    result = run_db("keys list", args, work)
    if isinstance(result, int):
        return result
    if wants_json(args):
        return print_rows(args, result, KEY_COLUMNS)
    now = datetime.now(UTC)
    return print_rows(args, [_table_row(info, now) for info in result], KEY_COLUMNS)


def run_show(args: argparse.Namespace) -> int:
    async def work(svc: Services) -> KeyInfo:
        return await svc.keys.get_key(args.key_id)

    result = run_db("keys show", args, work)
    return result if isinstance(result, int) else print_one(args, result)


def run_update(args: argparse.Namespace) -> int:
    async def work(svc: Services) -> KeyInfo:
        patch: dict[str, Any] = {}
        if args.name is not None:
            patch["name"] = args.name
        if args.no_expiry:
            patch["expires_at"] = None
        elif (expiry := _expiry(args)) is not None:
            patch["expires_at"] = expiry
        if args.scopes is not None:
            patch["scopes"] = args.scopes
        if args.all_models:
            patch["models"] = None
        elif args.models is not None:
            patch["models"] = args.models
        if args.rpm is not msgspec.UNSET:
            patch["requests_per_minute"] = args.rpm
        if not patch:
            raise ValueError("nothing to change: see `atrium keys update --help`")
        spec = msgspec.convert(patch, KeyPatch)
        return await svc.keys.update_key(args.key_id, spec, actor=CLI_ACTOR)

    result = run_db("keys update", args, work)
    return result if isinstance(result, int) else print_one(args, result)


def run_rotate(args: argparse.Namespace) -> int:
    async def work(svc: Services) -> dict[str, Any]:
        rotate = KeyRotate(
            overlap_seconds=round(args.overlap.total_seconds()), expires_at=_expiry(args)
        )
        new, key, old = await svc.keys.rotate_key(args.key_id, rotate, actor=CLI_ACTOR)
        return {
            "id": new.id,
            "key": key,
            "tenant_id": new.tenant_id,
            "name": new.name,
            "expires_at": new.expires_at,
            "replaces": old.id,
            "replaces_until": old.expires_at,
        }

    result = run_db("keys rotate", args, work)
    return result if isinstance(result, int) else print_json(result)


def run_revoke(args: argparse.Namespace) -> int:
    async def work(svc: Services) -> KeyInfo:
        return await svc.keys.revoke_key(args.key_id, actor=CLI_ACTOR)

    result = run_db("keys revoke", args, work)
    return result if isinstance(result, int) else print_one(args, result)


def _command(commands: Any, name: str, help_text: str, func: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = commands.add_parser(
        name, help=help_text, description=f"{help_text}. {DIRECT_NOTE}"
    )
    database_flag(parser)
    parser.set_defaults(func=func)
    return parser


def _expiry_flags(parser: argparse.ArgumentParser, what: str) -> None:
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--expires-in", type=duration, metavar="DURATION", help=f"{what} (1h, 90d)")
    group.add_argument("--expires-at", type=instant, metavar="TIME", help="ISO 8601 (UTC if naive)")


def _policy_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--scopes", type=names, help=f"comma-separated, of: {', '.join(SCOPES)} (default: all)"
    )
    parser.add_argument("--models", type=names, help="comma-separated models (default: every one)")


def register(subparsers: Any) -> None:
    """Add `keys` to the `atrium` command line."""
    keys = subparsers.add_parser("keys", help="manage API keys", description=DIRECT_NOTE)
    commands = keys.add_subparsers(dest="keys_command", required=True)
    create = _command(
        commands, "create", "issue a key and print it as JSON; the key is shown this once only",
        run_create,
    )  # fmt: skip
    create.add_argument("tenant", metavar="TENANT", help=TENANT_HELP)
    create.add_argument(
        "--name",
        default=DEFAULT_KEY_NAME,
        help=f"what the key is for, shown in lists (default: {DEFAULT_KEY_NAME!r})",
    )
    _expiry_flags(create, "the key stops working after")
    _policy_flags(create)
    create.add_argument("--rpm", type=count_or_none, help="requests/min of this key")
    json_flag(create)

    listing = _command(commands, "list", "list a tenant's keys (never their secrets)", run_list)
    listing.add_argument("tenant", metavar="TENANT", help=TENANT_HELP)
    output_flags(listing, wide=True)
    show = _command(commands, "show", "show one key", run_show)
    show.add_argument("key_id", metavar="KEY_ID", help=KEY_ID_HELP)
    output_flags(show)

    update = _command(
        commands, "update", "change a key's expiry, scopes, models or rpm", run_update
    )
    update.add_argument("key_id", metavar="KEY_ID", help=KEY_ID_HELP)
    update.add_argument("--name", help="a new name")
    _expiry_flags(update, "the key stops working after, from now")
    update.add_argument("--no-expiry", action="store_true", help="the key never expires")
    _policy_flags(update)
    update.add_argument("--all-models", action="store_true", help="allow every model")
    update.add_argument(
        "--rpm", type=count_or_none, default=msgspec.UNSET, metavar="N|none", help="requests/min"
    )
    output_flags(update)

    rotate = _command(
        commands,
        "rotate",
        "issue a successor (printed once); the old key works for --overlap more",
        run_rotate,
    )
    rotate.add_argument("key_id", metavar="KEY_ID", help=KEY_ID_HELP)
    rotate.add_argument("--overlap", type=duration, default="1h", help="default 1h; 0 stops it now")
    _expiry_flags(rotate, "the new key stops working after")
    json_flag(rotate)

    revoke = _command(
        commands, "revoke", "revoke a key (effective on its next request)", run_revoke
    )
    revoke.add_argument("key_id", metavar="KEY_ID", help=KEY_ID_HELP)
    output_flags(revoke)
