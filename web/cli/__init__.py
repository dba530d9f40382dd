"""The ``atrium`` command line: every module of ``COMMAND_MODULES`` registers its subcommands
(``register(subparsers)``, setting ``func(args) -> int`` as default).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from web.ops.logging import configure_logging

EXIT_USAGE = 2
# The modules that register subcommands, in the order they appear in `atrium --help`.
COMMAND_MODULES = (
    "web.cli.generate",
    "web.cli.model",
    "web.cli.serve",
    "web.cli.db_commands",
    "web.cli.key_commands",
    "web.cli.prefix_commands",
    "web.cli.price_commands",
    "web.cli.report_commands",
    "web.cli.tenant_commands",
)


def env_default(name: str, default: str | None = None) -> str | None:
    """The default of a flag: its ``ATRIUM_*`` environment twin when set."""
    value = os.environ.get(name)
    return default if value is None or value == "" else value


def env_flag(name: str) -> bool:
    return (os.environ.get(name) or "").strip().lower() in {"1", "true", "yes", "on"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="atrium", description="Multi-tenant LLM serving")
    parser.add_argument(
        "--log-level",
        default=env_default("ATRIUM_LOG_LEVEL", "info"),
        choices=["debug", "info", "warning"],
        help="structlog level (env ATRIUM_LOG_LEVEL)",
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        register = getattr(importlib.import_module(name), "register", None)
        if callable(register):
            register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(args.log_level)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    status = func(args)
    return int(status or 0)
