"""`atrium usage`, `atrium billing export` and `atrium audit`: reading what was used, what it
costs and who changed what, on the database directly."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from tenants.records import AuditRecord, BillingManifest, ModelUsageBucket
from web.cli.output import Column, output_flags, print_one, print_rows
from web.cli.runner import DIRECT_NOTE, TENANT_HELP, Services, database_flag, run_db
from web.cli.values import instant, window, window_flags

USAGE_COLUMNS = (
    Column("tenant_name", "tenant", whole=True),
    Column("tenant_id", "tenant id", whole=True, wide=True),
    Column("model", "model"),
    Column("start", "start"),
    Column("requests", "requests"),
    Column("prompt_tokens", "prompt"),
    Column("cached_tokens", "cached"),
    Column("completion_tokens", "completion"),
)
AUDIT_COLUMNS = (
    Column("id", "id"),
    Column("at", "at"),
    Column("actor", "actor"),
    Column("action", "action"),
    Column("target", "target", whole=True),
)


def run_usage(args: argparse.Namespace) -> int:
    async def work(svc: Services) -> list[ModelUsageBucket]:
        start, end = window(args.start, args.end)
        tenant_id = None if args.tenant is None else await svc.tenants.resolve(args.tenant)
        return await svc.reports.usage_by_model(start, end, args.granularity, tenant_id)

    result = run_db("usage", args, work)
    return result if isinstance(result, int) else print_rows(args, result, USAGE_COLUMNS)


def run_billing_export(args: argparse.Namespace) -> int:
    """The export's bytes to stdout (or ``--output``, then its manifest is printed)."""

    async def work(svc: Services) -> tuple[bytes, BillingManifest]:
        return await svc.billing.billing_export(args.start, args.end, args.format)

    result = run_db("billing export", args, work)
    if isinstance(result, int):
        return result
    data, manifest = result
    if args.output_file is None:
        sys.stdout.buffer.write(data)
        sys.stdout.flush()
        return 0
    try:
        args.output_file.write_bytes(data)
    except OSError as exc:
        print(f"atrium billing export: cannot write {args.output_file}: {exc}", file=sys.stderr)
        return 1
    return print_one(args, manifest)


def run_audit(args: argparse.Namespace) -> int:
    async def work(svc: Services) -> list[AuditRecord]:
        start, end = window(args.start, args.end)
        entries = await svc.audit.entries(start, end)
        if args.action:
            entries = [e for e in entries if e.action.startswith(args.action)]
        if args.target:
            entries = [e for e in entries if e.target == args.target]
        return entries

    result = run_db("audit", args, work)
    return result if isinstance(result, int) else print_rows(args, result, AUDIT_COLUMNS)


def _parser(subparsers: Any, name: str, help_text: str) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        name, help=help_text, description=f"{help_text}. {DIRECT_NOTE}"
    )
    database_flag(parser)
    return parser


def register(subparsers: Any) -> None:
    """Add `usage`, `billing` and `audit` to the `atrium` command line."""
    usage = _parser(subparsers, "usage", "token usage per tenant and model by hour or day (UTC)")
    usage.add_argument("--tenant", metavar="TENANT", help=f"{TENANT_HELP} (default: every one)")
    usage.add_argument(
        "--granularity", choices=["hour", "day"], default="day", help="bucket size (default day)"
    )
    window_flags(usage)
    output_flags(usage, wide=True)
    usage.set_defaults(func=run_usage)

    billing = subparsers.add_parser("billing", help="billing export", description=DIRECT_NOTE)
    commands = billing.add_subparsers(dest="billing_command", required=True)
    export = _parser(commands, "export", "one row per tenant and model over [start, end)")
    export.add_argument("--start", type=instant, required=True, help="ISO 8601, inclusive")
    export.add_argument("--end", type=instant, required=True, help="ISO 8601, exclusive")
    export.add_argument(
        "--format", choices=["csv", "jsonl"], default="csv", help="the rows' format (default csv)"
    )
    export.add_argument(
        "--output", dest="output_file", type=Path, help="write here and print the manifest"
    )
    output_flags(export)
    export.set_defaults(func=run_billing_export)

    audit = _parser(subparsers, "audit", "admin changes, oldest first")
    window_flags(audit)
    audit.add_argument("--action", help="only actions starting with this (e.g. key.)")
    audit.add_argument("--target", help="only changes of this tenant, key or model (its id)")
    output_flags(audit, wide=True)
    audit.set_defaults(func=run_audit)
