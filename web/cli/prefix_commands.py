"""`atrium public-prefixes publish|list|unpublish`: prefixes every tenant may reuse, stored in the
database; running gateways deliver a change to their engines within seconds."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import msgspec

from tenants.public_prefixes import PublicPrefixInfo
from web.cli.output import Column, output_flags, print_one, print_rows, wants_json
from web.cli.runner import (
    CLI_ACTOR,
    DIRECT_NOTE,
    EXIT_INVALID,
    Services,
    database_flag,
    fail,
    run_db,
)

NOTE = (
    f"{DIRECT_NOTE} A running gateway publishes a change into its engine within a few seconds "
    "(at once through the admin API); published prefixes are published again at every start."
)
PREFIX_COLUMNS = (
    Column("id", "id", whole=True),
    Column("text", "text"),
    Column("created_at", "created"),
    Column("created_by", "by"),
    Column("unpublished_at", "unpublished"),
)
PREVIEW_CHARS = 60


def _preview(info: PublicPrefixInfo, chars: int | None) -> dict[str, Any]:
    """The row as a table shows it: the text on one line, cut at ``chars`` (None: whole)."""
    row = msgspec.structs.asdict(info)
    text = " ".join(info.text.split())
    row["text"] = text if chars is None or len(text) <= chars else text[: chars - 1] + "…"
    return row


def _rows(args: argparse.Namespace, found: list[PublicPrefixInfo]) -> int:
    if wants_json(args):
        return print_rows(args, found, PREFIX_COLUMNS)
    chars = None if args.wide else PREVIEW_CHARS
    return print_rows(args, [_preview(p, chars) for p in found], PREFIX_COLUMNS)


def run_publish(args: argparse.Namespace) -> int:
    name = "public-prefixes publish"
    if args.file is not None and args.text is not None:
        return fail(name, "give the prefix text or --file, not both", EXIT_INVALID)
    if args.file is not None:
        try:
            text = args.file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            return fail(name, f"cannot read {args.file}: {exc}", EXIT_INVALID)
    else:
        text = args.text or ""

    async def work(svc: Services) -> PublicPrefixInfo:
        return await svc.public_prefixes.publish(text, actor=CLI_ACTOR)

    result = run_db(name, args, work)
    return result if isinstance(result, int) else print_one(args, result)


def run_list(args: argparse.Namespace) -> int:
    async def work(svc: Services) -> list[PublicPrefixInfo]:
        return await svc.public_prefixes.list_prefixes(include_unpublished=args.all)

    result = run_db("public-prefixes list", args, work)
    return result if isinstance(result, int) else _rows(args, result)


def run_unpublish(args: argparse.Namespace) -> int:
    async def work(svc: Services) -> PublicPrefixInfo:
        return await svc.public_prefixes.unpublish(args.prefix_id, actor=CLI_ACTOR)

    result = run_db("public-prefixes unpublish", args, work)
    return result if isinstance(result, int) else print_one(args, result)


def register(subparsers: Any) -> None:
    """Add `public-prefixes` to the `atrium` command line."""
    prefixes = subparsers.add_parser(
        "public-prefixes", help="prefixes every tenant may reuse", description=NOTE
    )
    commands = prefixes.add_subparsers(dest="prefixes_command", required=True)
    publish = commands.add_parser("publish", help="publish a prefix", description=NOTE)
    publish.add_argument("text", nargs="?", help="the prefix text (or --file)")
    publish.add_argument("--file", type=Path, help="read the prefix text from this file (UTF-8)")
    database_flag(publish)
    output_flags(publish)
    publish.set_defaults(func=run_publish)

    listing = commands.add_parser("list", help="published prefixes, oldest first")
    listing.add_argument("--all", action="store_true", help="unpublished ones too")
    database_flag(listing)
    output_flags(listing, wide=True)
    listing.set_defaults(func=run_list)

    unpublish = commands.add_parser("unpublish", help="stop publishing a prefix", description=NOTE)
    unpublish.add_argument("prefix_id", metavar="ID", help="the prefix's id (pp_…)")
    database_flag(unpublish)
    output_flags(unpublish)
    unpublish.set_defaults(func=run_unpublish)
