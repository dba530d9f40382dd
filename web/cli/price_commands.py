"""`atrium prices set|list`: model prices per million tokens, on the database directly."""

from __future__ import annotations

import argparse
from typing import Any

from tenants.records import PriceInfo, PriceSet
from web.cli.output import Column, output_flags, print_one, print_rows
from web.cli.runner import CLI_ACTOR, DIRECT_NOTE, Services, database_flag, run_db
from web.cli.values import instant

PRICE_COLUMNS = (
    Column("model", "model", whole=True),
    Column("input_per_million", "input/M"),
    Column("cached_input_per_million", "cached input/M"),
    Column("output_per_million", "output/M"),
    Column("currency", "currency"),
    Column("batch_discount_percent", "batch -%"),
    Column("effective_from", "from"),
)
MICROS_NOTE = "integer micro-units of the currency per million tokens (1 USD = 1000000)"


def run_set(args: argparse.Namespace) -> int:
    async def work(svc: Services) -> PriceInfo:
        spec = PriceSet(
            input_per_million=args.input_price,
            cached_input_per_million=args.cached_input_price,
            output_per_million=args.output_price,
            currency=args.currency,
            effective_from=args.effective_from,
            batch_discount_percent=args.batch_discount,
        )
        return await svc.prices.set_price(args.model, spec, actor=CLI_ACTOR)

    result = run_db("prices set", args, work)
    return result if isinstance(result, int) else print_one(args, result)


def run_list(args: argparse.Namespace) -> int:
    async def work(svc: Services) -> list[PriceInfo]:
        return await svc.prices.list_prices(args.model)

    result = run_db("prices list", args, work)
    return result if isinstance(result, int) else print_rows(args, result, PRICE_COLUMNS)


def register(subparsers: Any) -> None:
    """Add `prices` to the `atrium` command line."""
    prices = subparsers.add_parser("prices", help="model prices", description=DIRECT_NOTE)
    commands = prices.add_subparsers(dest="prices_command", required=True)
    setting = commands.add_parser(
        "set", help="set a model's price from now (or --effective-from)", description=MICROS_NOTE
    )
    setting.add_argument("model", metavar="MODEL", help="the served model's name")
    for flag, tokens in (
        ("--input-price", "prompt tokens"),
        ("--cached-input-price", "prompt tokens read from the prefix cache"),
        ("--output-price", "output tokens"),
    ):
        setting.add_argument(
            flag, type=int, required=True, metavar="MICROS", help=f"per million {tokens}"
        )
    setting.add_argument("--currency", default="USD", help="ISO 4217 code (default USD)")
    setting.add_argument(
        "--batch-discount", type=int, default=0, metavar="PERCENT",
        help="Batch API lines cost this many percent less (0-100)",
    )  # fmt: skip
    setting.add_argument(
        "--effective-from", type=instant, metavar="TIME", help="ISO 8601 (default: now)"
    )
    database_flag(setting)
    output_flags(setting)
    setting.set_defaults(func=run_set)

    listing = commands.add_parser("list", help="every price, history included")
    listing.add_argument("--model", help="only this model")
    database_flag(listing)
    output_flags(listing, wide=True)
    listing.set_defaults(func=run_list)
