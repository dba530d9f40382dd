"""`atrium tenants create|list|show|update|suspend|resume|delete`, on the database directly.

Every command that takes a tenant takes its id or its name.
"""

from __future__ import annotations

import argparse
from typing import Any

import msgspec

from tenants.schemas import TENANT_NAME_RULE, TenantCreate, TenantInfo, TenantPatch
from web.cli.output import Column, json_flag, output_flags, print_json, print_one, print_rows
from web.cli.runner import CLI_ACTOR, DIRECT_NOTE, TENANT_HELP, Services, database_flag, run_db
from web.cli.values import count_or_none, model_list_or_all, share_or_none

TENANT_COLUMNS = (
    Column("id", "id", whole=True),
    Column("name", "name", whole=True),
    Column("status", "status"),
    Column("weight", "weight"),
    Column("created_at", "created"),
    Column("quotas", "quotas"),
)
# flag -> (quota field, what it limits); each takes a number or `none` (unlimited)
QUOTA_FLAGS = {
    "--rpm": ("requests_per_minute", "requests a minute"),
    "--tpm": ("tokens_per_minute", "prompt and output tokens a minute"),
    "--max-concurrent": ("max_concurrent_requests", "requests running at once"),
    "--monthly-token-budget": ("monthly_token_budget", "tokens a calendar month (UTC)"),
    "--monthly-cost-budget": (
        "monthly_cost_budget",
        "cost a calendar month, in micro-units of the prices' currency (25000000 is 25.00)",
    ),
    "--max-prompt-tokens": ("max_prompt_tokens", "tokens in one prompt"),
}


def run_create(args: argparse.Namespace) -> int:
    async def work(svc: Services) -> TenantInfo:
        spec = msgspec.convert({"name": args.name, "weight": args.weight}, TenantCreate)
        return await svc.tenants.create(spec, actor=CLI_ACTOR)

    result = run_db("tenants create", args, work)
    return result if isinstance(result, int) else print_json(result)  # always JSON (CONTRACT)


def run_list(args: argparse.Namespace) -> int:
    async def work(svc: Services) -> list[TenantInfo]:
        return await svc.tenants.list_tenants(include_deleted=args.all)

    result = run_db("tenants list", args, work)
    return result if isinstance(result, int) else print_rows(args, result, TENANT_COLUMNS)


def run_show(args: argparse.Namespace) -> int:
    async def work(svc: Services) -> TenantInfo:
        return await svc.tenants.get(await svc.tenants.resolve(args.tenant))

    result = run_db("tenants show", args, work)
    return result if isinstance(result, int) else print_one(args, result)


def _patch(args: argparse.Namespace) -> dict[str, Any]:
    patch: dict[str, Any] = {}
    if getattr(args, "weight", None) is not None:
        patch["weight"] = args.weight
    quotas = {
        field: getattr(args, field)
        for field in (*(field for field, _ in QUOTA_FLAGS.values()), "kv_cache_share", "models")
        if getattr(args, field, msgspec.UNSET) is not msgspec.UNSET
    }
    if quotas:
        patch["quotas"] = quotas
    if getattr(args, "status", None) is not None:
        patch["status"] = args.status
    return patch


def run_update(args: argparse.Namespace) -> int:
    name = f"tenants {args.tenants_command}"

    async def work(svc: Services) -> TenantInfo:
        patch = _patch(args)
        if not patch:
            raise ValueError("nothing to change: give --weight or a quota flag")
        spec = msgspec.convert(patch, TenantPatch)
        tenant_id = await svc.tenants.resolve(args.tenant)
        return await svc.tenants.update(tenant_id, spec, actor=CLI_ACTOR)

    result = run_db(name, args, work)
    return result if isinstance(result, int) else print_one(args, result)


def run_delete(args: argparse.Namespace) -> int:
    async def work(svc: Services) -> TenantInfo:
        return await svc.tenants.delete(await svc.tenants.resolve(args.tenant), actor=CLI_ACTOR)

    result = run_db("tenants delete", args, work)
    return result if isinstance(result, int) else print_one(args, result)


def _command(commands: Any, name: str, help_text: str, func: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = commands.add_parser(
        name, help=help_text, description=f"{help_text}. {DIRECT_NOTE}"
    )
    database_flag(parser)
    parser.set_defaults(func=func)
    return parser


def register(subparsers: Any) -> None:
    """Add `tenants` to the `atrium` command line."""
    tenants = subparsers.add_parser("tenants", help="manage tenants", description=DIRECT_NOTE)
    commands = tenants.add_subparsers(dest="tenants_command", required=True)
    create = _command(commands, "create", "create a tenant and print it as JSON", run_create)
    create.add_argument("name", metavar="NAME", help=TENANT_NAME_RULE.removeprefix("name "))
    create.add_argument(
        "--weight", type=float, default=1.0, help="its share of the engine (fair share; default 1)"
    )
    json_flag(create)

    listing = _command(commands, "list", "list tenants", run_list)
    listing.add_argument("--all", action="store_true", help="include deleted tenants")
    output_flags(listing, wide=True)
    show = _command(commands, "show", "show one tenant", run_show)
    show.add_argument("tenant", metavar="TENANT", help=TENANT_HELP)
    output_flags(show)

    update = _command(commands, "update", "change a tenant's weight and quotas", run_update)
    update.add_argument("tenant", metavar="TENANT", help=TENANT_HELP)
    update.add_argument("--weight", type=float, help="its share of the engine (fair share)")
    for flag, (field, limits) in QUOTA_FLAGS.items():
        update.add_argument(
            flag,
            dest=field,
            type=count_or_none,
            default=msgspec.UNSET,
            metavar="N|none",
            help=f"the most {limits}; none: no limit",
        )
    update.add_argument(
        "--kv-cache-share",
        type=share_or_none,
        default=msgspec.UNSET,
        metavar="0..1|none",
        help="the most of the KV cache its cached prefixes may keep; none: no limit",
    )
    update.add_argument(
        "--models",
        type=model_list_or_all,
        default=msgspec.UNSET,
        metavar="A,B|all",
        help="the models the tenant's keys may call (comma-separated), or `all`",
    )
    output_flags(update)
    for name, status, text in (
        ("suspend", "suspended", "suspend a tenant: its keys get 403 until resumed"),
        ("resume", "active", "make a suspended tenant active again"),
    ):
        sub = _command(commands, name, text, run_update)
        sub.add_argument("tenant", metavar="TENANT", help=TENANT_HELP)
        sub.set_defaults(status=status)
        output_flags(sub)
    delete = _command(commands, "delete", "soft-delete a tenant and revoke its keys", run_delete)
    delete.add_argument("tenant", metavar="TENANT", help=TENANT_HELP)
    output_flags(delete)
