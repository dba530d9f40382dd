"""`atrium lora-adapters register|list|remove`: LoRA adapters tenants name in ``model``, on the
database directly (the admin API's `/admin/v1/lora-adapters` does the same, with checks only a
server can make)."""

from __future__ import annotations

import argparse
from typing import Any

from tenants.lora_adapters import LoraAdapterInfo
from web.cli.output import Column, output_flags, print_one, print_rows
from web.cli.runner import (
    CLI_ACTOR,
    DIRECT_NOTE,
    EXIT_INVALID,
    TENANT_HELP,
    Services,
    database_flag,
    fail,
    run_db,
)

NOTE = (
    f"{DIRECT_NOTE} Neither the folder nor the base model is checked here: the admin API of a "
    "server checks both (whether it serves the model and, in all-in-one, the folder); an engine "
    "refuses a request whose adapter does not fit its model."
)
ADAPTER_COLUMNS = (
    Column("id", "id", whole=True),
    Column("name", "name", whole=True),
    Column("base_model", "base model"),
    Column("tenant_id", "tenant"),
    Column("path", "path"),
    Column("created_at", "created", wide=True),
    Column("created_by", "by", wide=True),
)


async def _tenant_id(svc: Services, tenant: str | None) -> str | None:
    return None if tenant is None else await svc.tenants.resolve(tenant)


def run_register(args: argparse.Namespace) -> int:
    if not args.path.startswith("/"):
        return fail("lora-adapters register", "PATH must be an absolute folder path", EXIT_INVALID)

    async def work(svc: Services) -> LoraAdapterInfo:
        tenant_id = await _tenant_id(svc, args.tenant)
        return await svc.lora_adapters.register(
            args.name, args.path, tenant_id, base_model=args.base_model, actor=CLI_ACTOR
        )

    result = run_db("lora-adapters register", args, work)
    return result if isinstance(result, int) else print_one(args, result)


def run_list(args: argparse.Namespace) -> int:
    async def work(svc: Services) -> list[LoraAdapterInfo]:
        return await svc.lora_adapters.list_adapters(await _tenant_id(svc, args.tenant))

    result = run_db("lora-adapters list", args, work)
    return result if isinstance(result, int) else print_rows(args, result, ADAPTER_COLUMNS)


def run_remove(args: argparse.Namespace) -> int:
    async def work(svc: Services) -> LoraAdapterInfo:
        return await svc.lora_adapters.remove(args.adapter_id, actor=CLI_ACTOR)

    result = run_db("lora-adapters remove", args, work)
    return result if isinstance(result, int) else print_one(args, result)


def register(subparsers: Any) -> None:
    """Add `lora-adapters` to the `atrium` command line."""
    adapters = subparsers.add_parser(
        "lora-adapters", help="LoRA adapters tenants name in `model`", description=NOTE
    )
    commands = adapters.add_subparsers(dest="adapters_command", required=True)
    create = commands.add_parser("register", help="register an adapter folder", description=NOTE)
    create.add_argument("name", metavar="NAME", help="what requests put in `model`")
    create.add_argument(
        "path", metavar="PATH", help="the PEFT folder on the engines' disks (absolute)"
    )
    create.add_argument("--tenant", help=f"{TENANT_HELP}; default: every tenant may use it")
    create.add_argument(
        "--base-model",
        dest="base_model",
        metavar="MODEL",
        help="the served model it rides on (default: the first served model)",
    )
    database_flag(create)
    output_flags(create)
    create.set_defaults(func=run_register)

    listing = commands.add_parser("list", help="adapters by name")
    listing.add_argument("--tenant", help=f"only those this tenant may use ({TENANT_HELP})")
    database_flag(listing)
    output_flags(listing, wide=True)
    listing.set_defaults(func=run_list)

    remove = commands.add_parser("remove", help="remove an adapter (running requests keep it)")
    remove.add_argument("adapter_id", metavar="ID", help="the adapter's id (la_…)")
    database_flag(remove)
    output_flags(remove)
    remove.set_defaults(func=run_remove)
