"""The ``atrium`` command line: ``COMMANDS`` names the module that registers each subcommand
(``register(subparsers)``, setting ``func(args) -> int`` as default).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from web.cli.env import EXIT_USAGE, env_default
from web.ops.logging import configure_logging

# Each top-level command and the module that registers it, in `atrium --help` order. A run imports
# only its command's module, so the SQL commands never load the engine (nor torch).
COMMANDS: dict[str, str] = {
    "generate": "web.cli.generate",
    "model": "web.cli.model",
    "serve": "web.cli.serve",
    "kernels": "web.cli.kernels",
    "db": "web.cli.db_commands",
    "keys": "web.cli.key_commands",
    "public-prefixes": "web.cli.prefix_commands",
    "lora-adapters": "web.cli.adapter_commands",
    "prices": "web.cli.price_commands",
    "usage": "web.cli.report_commands",
    "billing": "web.cli.report_commands",
    "audit": "web.cli.report_commands",
    "tenants": "web.cli.tenant_commands",
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser for ``command`` (and the commands its module shares), or for every command."""
    parser = argparse.ArgumentParser(prog="atrium", description="Multi-tenant LLM serving")
    parser.add_argument(
        "--log-level",
        default=env_default("ATRIUM_LOG_LEVEL", "info"),
        choices=["debug", "info", "warning"],
        help="structlog level (env ATRIUM_LOG_LEVEL)",
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    modules = [COMMANDS[command]] if command in COMMANDS else list(COMMANDS.values())
    for name in dict.fromkeys(modules):
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # The first word that names a command picks it (only --log-level, whose values name no
    # command, may come before it).
    parser = build_parser(next((word for word in argv if word in COMMANDS), None))
    args = parser.parse_args(argv)
    configure_logging(args.log_level)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    status = func(args)
    return int(status or 0)
