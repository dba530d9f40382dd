"""What admin commands print: a rich table for people on a terminal, JSON for scripts.

JSON is chosen by ``--json`` or when stdout is not a terminal; ``--table`` forces the table.
A table never shortens an id (what other commands take): its column keeps its full width, and
the table grows past the terminal's width rather than cut one. Other cells wrap; ``--wide``
adds the columns a list leaves out and draws every row on one line.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from datetime import datetime
from typing import Any, NamedTuple

import msgspec
from rich.console import Console
from rich.table import Table

PIPE_WIDTH = 160  # a table drawn into a pipe (``--table``) when ``COLUMNS`` says no width
BORDER = 3  # a column's share of the table's borders and padding (one more closes the row)


class Column(NamedTuple):
    field: str
    heading: str
    whole: bool = False  # an id or a secret's prefix: never wrapped, never shortened
    wide: bool = False  # shown with ``--wide`` only


Columns = Sequence[Column]


def output_flags(parser: argparse.ArgumentParser, *, wide: bool = False) -> None:
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--json", dest="output", action="store_const", const="json", help="print JSON"
    )
    group.add_argument(
        "--table", dest="output", action="store_const", const="table", help="print a table"
    )
    parser.set_defaults(output=None)
    if wide:
        parser.add_argument(
            "--wide",
            action="store_true",
            help="every column, each row on one line (wider than the terminal if need be)",
        )


def json_flag(parser: argparse.ArgumentParser) -> None:
    """``--json`` for a command that prints JSON whatever is asked (so scripts may say so)."""
    parser.add_argument(
        "--json",
        dest="output",
        action="store_const",
        const="json",
        help="print JSON (the default: this command prints nothing else)",
    )
    parser.set_defaults(output="json")


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
        return ", ".join(cell(v) for v in value) or "-"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, dict):
        return " ".join(f"{k}={cell(v)}" for k, v in value.items() if v is not None) or "-"
    return str(value)


def _fields(row: Any) -> dict[str, Any]:
    if isinstance(row, msgspec.Struct):
        return {f: getattr(row, f) for f in row.__struct_fields__}
    return dict(row)


def _terminal_width() -> int:
    """The terminal's width; into a pipe, ``COLUMNS`` or ``PIPE_WIDTH``."""
    if sys.stdout.isatty():
        return Console(file=sys.stdout).width
    columns = os.environ.get("COLUMNS", "")
    return int(columns) if columns.isdigit() and int(columns) > 0 else PIPE_WIDTH


def _print(table: Table, width: int) -> None:
    Console(file=sys.stdout, width=width).print(table)


def column_widths(natural: list[int], least: list[int], room: int) -> list[int]:
    """Each column's width: ``natural`` (its longest cell) when all fit in ``room``, else at
    least ``least`` (its longest word; an id's whole length) and the room left shared out in
    proportion to what each column lacks."""
    if sum(natural) <= room:
        return natural
    widths = list(least)
    spare = room - sum(least)
    lacking = [n - w for n, w in zip(natural, widths, strict=True)]
    if spare > 0 and sum(lacking) > 0:
        total = sum(lacking)
        widths = [w + spare * lack // total for w, lack in zip(widths, lacking, strict=True)]
    return widths


def _longest_word(text: str) -> int:
    return max((len(word) for word in text.split()), default=1)


def print_rows(args: argparse.Namespace, rows: Sequence[Any], columns: Columns) -> int:
    """Rows as a JSON array, or a table of ``columns`` (the wide ones with ``--wide``)."""
    if wants_json(args):
        return print_json(list(rows))
    wide = bool(getattr(args, "wide", False))
    shown = [column for column in columns if wide or not column.wide]
    cells = [[cell(_fields(row).get(c.field)) for c in shown] for row in rows]
    texts = [[c.heading, *(r[i] for r in cells)] for i, c in enumerate(shown)]
    natural = [max(len(text) for text in column) for column in texts]
    least = [
        longest if column.whole else max(_longest_word(text) for text in column_texts)
        for longest, column, column_texts in zip(natural, shown, texts, strict=True)
    ]
    overhead = BORDER * len(shown) + 1
    room = (10**6 if wide else _terminal_width()) - overhead
    widths = column_widths(natural, least, room)
    table = Table(show_lines=False)
    for column, width in zip(shown, widths, strict=True):
        table.add_column(column.heading, width=width, no_wrap=column.whole, overflow="fold")
    for values in cells:
        table.add_row(*values)
    _print(table, max(sum(widths) + overhead, _terminal_width()))
    if not rows:
        print("(none)")
    return 0


def print_one(args: argparse.Namespace, value: Any) -> int:
    """One object as JSON, or a two-column table of its fields (values wrap, never shortened)."""
    if wants_json(args):
        return print_json(value)
    table = Table("field", "value", show_header=False)
    table.columns[0].no_wrap = True
    table.columns[1].overflow = "fold"
    for name, field_value in _fields(value).items():
        table.add_row(name, cell(field_value))
    _print(table, _terminal_width())
    return 0
