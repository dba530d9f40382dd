"""Pure parts of the billing export: cost arithmetic and deterministic CSV / JSON-lines bytes."""

from __future__ import annotations

import csv
import hashlib
import io
from collections.abc import Sequence
from datetime import datetime

import msgspec

from tenants.records import BillingManifest, BillingRow, ExportFormat, PriceInfo

MICROS = 1_000_000
TOKENS_PER_PRICE_UNIT = 1_000_000  # prices are per million tokens
COLUMNS = tuple(BillingRow.__struct_fields__)


def cost_numerator(price: PriceInfo, prompt: int, cached: int, completion: int) -> int:
    """Cost in micro-units × 10⁶ (exact); cached prompt tokens are priced apart."""
    return (
        (prompt - cached) * price.input_per_million
        + cached * price.cached_input_per_million
        + completion * price.output_per_million
    )


def round_micros(numerator: int, scale: int = 1) -> int:
    """Exact numerator (times ``scale``) → micro-units, rounding half up once per export row."""
    unit = TOKENS_PER_PRICE_UNIT * scale
    return (numerator + unit // 2) // unit


def format_money(micros: int) -> str:
    return f"{micros // MICROS}.{micros % MICROS:06d}"


# A spreadsheet evaluates a cell starting with one of these as a formula (CSV injection).
FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def spreadsheet_safe(value: object) -> object:
    """A text cell a spreadsheet would run as a formula, prefixed with ``'`` so it shows as text;
    numbers and other text unchanged. A carriage return becomes a newline: the writer quotes
    cells holding its line terminator (``\n``) but not a bare ``\r``, which would split the row.
    (JSON lines keep the values as they are.)"""
    if not isinstance(value, str):
        return value
    if value.startswith(FORMULA_STARTS):
        value = "'" + value
    return value.replace("\r\n", "\n").replace("\r", "\n")


def render(rows: Sequence[BillingRow], fmt: ExportFormat) -> bytes:
    if fmt == "jsonl":
        return b"".join(msgspec.json.encode(row) + b"\n" for row in rows)
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(COLUMNS)
    for row in rows:
        writer.writerow([spreadsheet_safe(getattr(row, name)) for name in COLUMNS])
    return buffer.getvalue().encode("utf-8")


def manifest(
    rows: Sequence[BillingRow],
    data: bytes,
    *,
    start: datetime,
    end: datetime,
    fmt: ExportFormat,
    unpriced_requests: int,
) -> BillingManifest:
    costs: dict[str, int] = {}
    for row in rows:
        if row.currency:
            costs[row.currency] = costs.get(row.currency, 0) + row.cost_micros
    return BillingManifest(
        start=start,
        end=end,
        format=fmt,
        rows=len(rows),
        requests=sum(r.requests for r in rows),
        prompt_tokens=sum(r.prompt_tokens for r in rows),
        cached_tokens=sum(r.cached_tokens for r in rows),
        completion_tokens=sum(r.completion_tokens for r in rows),
        cost_micros=dict(sorted(costs.items())),
        unpriced_requests=unpriced_requests,
        sha256=hashlib.sha256(data).hexdigest(),
    )
