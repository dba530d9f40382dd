"""What admin commands print: a rich table for people on a terminal, JSON for scripts.

JSON is chosen by ``--json`` or when stdout is not a terminal; ``--table`` forces the table.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import msgspec
from rich.console import Console
from rich.table import Table

Columns = Sequence[tuple[str, str]]  # (field, heading)


def output_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--json", dest="output", action="store_const", const="json", help="print JSON"
    )
    group.add_argument(
        "--table", dest="output", action="store_const", const="table", help="print a table"
    )
    parser.set_defaults(output=None)


def wants_json(args: argparse.Namespace) -> bool:
    choice = getattr(args, "output", None)
    return choice == "json" or (choice is None and not sys.stdout.isatty())


def print_json(value: Any) -> int:
    sys.stdout.write(msgspec.json.encode(value).decode("utf-8") + "\n")
    return 0


def cell(value: Any) -> str:
    if isinstance(value, msgspec.Struct):
        value = msgspec.structs.asdict(value)
    if value is None:
        return "-"
    if isinstance(value, datetime):
        return value.strftime("%Y-%m-%d %H:%M:%SZ")
    if isinstance(value, list | tuple):
        return ",".join(cell(v) for v in value) or "-"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, dict):
        return " ".join(f"{k}={cell(v)}" for k, v in value.items() if v is not None) or "-"
    return str(value)


def _fields(row: Any) -> dict[str, Any]:
    if isinstance(row, msgspec.Struct):
        return {f: getattr(row, f) for f in row.__struct_fields__}
    return dict(row)


def _console() -> Console:
    # Off a terminal (``--table`` into a pipe) rich draws plain text at a fixed width.
    return Console(file=sys.stdout, width=None if sys.stdout.isatty() else 160)


def print_rows(args: argparse.Namespace, rows: Sequence[Any], columns: Columns) -> int:
    """Rows as a JSON array, or a table of ``columns``."""
    if wants_json(args):
        return print_json(list(rows))
    table = Table(*(heading for _, heading in columns), show_lines=False)
    for row in rows:
        fields = _fields(row)
        table.add_row(*(cell(fields.get(name)) for name, _ in columns))
    _console().print(table)
    if not rows:
        print("(none)")
    return 0


def print_one(args: argparse.Namespace, value: Any) -> int:
    """One object as JSON, or a two-column table of its fields."""
    if wants_json(args):
        return print_json(value)
    table = Table("field", "value", show_header=False)
    for name, field_value in _fields(value).items():
        table.add_row(name, cell(field_value))
    _console().print(table)
    return 0
