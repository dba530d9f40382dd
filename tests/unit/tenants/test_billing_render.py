"""Billing arithmetic and rendering: exact costs, half-up rounding, stable bytes."""

from __future__ import annotations

import csv
import io
from datetime import UTC, datetime

import msgspec

from tenants.billing_render import cost_numerator, format_money, manifest, render, round_micros
from tenants.records import BillingRow, PriceInfo

PRICE = PriceInfo(
    model="m",
    input_per_million=3_000_000,
    cached_input_per_million=300_000,
    output_per_million=15_000_000,
    currency="USD",
    effective_from=datetime(2030, 1, 1, tzinfo=UTC),
)


def _row(tenant: str, micros: int, currency: str = "USD") -> BillingRow:
    return BillingRow(
        tenant_id=tenant,
        tenant_name=f"name {tenant}",
        model="m",
        requests=1,
        prompt_tokens=10,
        cached_tokens=4,
        completion_tokens=2,
        cost=format_money(micros),
        cost_micros=micros,
        currency=currency,
    )


def test_cached_tokens_are_priced_apart() -> None:
    # 600 uncached × 3 + 400 cached × 0.3 + 100 output × 15 (all per million, in units)
    assert cost_numerator(PRICE, 1000, 400, 100) == 600 * 3_000_000 + 400 * 300_000 + 1_500_000_000
    assert round_micros(cost_numerator(PRICE, 1000, 400, 100)) == 3420


def test_rounding_is_half_up_and_money_has_six_decimals() -> None:
    assert [round_micros(n) for n in (499_999, 500_000, 1_499_999)] == [0, 1, 1]
    assert format_money(16_200) == "0.016200"
    assert format_money(12_345_678) == "12.345678"


def test_render_and_manifest() -> None:
    rows = [_row("a", 5), _row("b", 7), _row("c", 11, "EUR")]
    data = render(rows, "csv")
    assert data.splitlines()[0] == (
        b"tenant_id,tenant_name,model,requests,prompt_tokens,cached_tokens,"
        b"completion_tokens,cost,cost_micros,currency"
    )
    assert data.splitlines()[1] == b"a,name a,m,1,10,4,2,0.000005,5,USD"
    assert render(rows, "jsonl").count(b"\n") == 3
    start, end = datetime(2030, 1, 1, tzinfo=UTC), datetime(2030, 2, 1, tzinfo=UTC)
    info = manifest(rows, data, start=start, end=end, fmt="csv", unpriced_requests=0)
    assert info.cost_micros == {"EUR": 11, "USD": 12}
    assert (info.rows, info.requests, info.prompt_tokens) == (3, 3, 30)


def test_csv_cells_a_spreadsheet_would_run_as_formulas_are_shown_as_text() -> None:
    names = ['=HYPERLINK("http://x","y")', "+1+1", "-2+3", "@SUM(A1)", "\tcmd", "\rcmd", "a=b"]
    rows = [
        msgspec.structs.replace(_row(f"t{i}", 1), tenant_name=name, model=f"={i}")
        for i, name in enumerate(names)
    ]
    text = render(rows, "csv").decode()
    parsed = list(csv.reader(io.StringIO(text, newline="")))[1:]
    assert len(parsed) == len(rows)  # a carriage return in a cell does not split its row
    shown = ["'" + n.replace("\r", "\n") for n in names[:-1]] + ["a=b"]
    assert [r[1] for r in parsed] == shown
    assert all(r[2].startswith("'=") for r in parsed)
    assert all(r[3] == "1" and r[7] == "0.000001" for r in parsed)  # numbers stay numbers
    # JSON lines carry the names unchanged.
    first = msgspec.json.decode(render(rows, "jsonl").splitlines()[0])
    assert first["tenant_name"] == names[0]
