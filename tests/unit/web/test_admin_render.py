"""Readable numbers on console pages, and the engine snapshot as the overview draws it."""

from __future__ import annotations

from datetime import UTC, datetime

from engine.stats import EngineSnapshot, EngineStats
from web.admin.engine_state import TokenRate, to_engine_state
from web.console.render import compact, limit, money, num, share, when


def test_numbers_get_separators_and_units() -> None:
    assert num(1234567) == "1,234,567"
    assert num(2.0) == "2"
    assert num(1234.5678) == "1,234.57"
    assert limit(None) == "unlimited"
    assert limit(50000, "tokens") == "50,000 tokens"
    assert share(0.25) == "25 %" and share(None) == "unlimited"


def test_money_is_exact_from_micro_units() -> None:
    assert money(1_500_000) == "1.50"
    assert money(400) == "0.0004"
    assert money(12_345_678_900) == "12,345.6789"
    assert money(-2_000_000) == "-2.00"


def test_times_and_snapshots() -> None:
    assert when(datetime(2025, 3, 4, 9, 5, tzinfo=UTC)) == "2025-03-04 09:05 UTC"
    assert when(None) == "—"
    assert compact({"b": 1, "a": None}) == '{"a":null,"b":1}'


def snapshot(**counters: int) -> EngineSnapshot:
    return EngineSnapshot(
        running_by_tenant={"tn_b": 1, "tn_a": 2},
        waiting_by_tenant={"tn_b": 3, "tn_c": 1},
        num_pages_total=512,
        num_pages_free=100,
        counters=EngineStats(**counters),
    )


def test_engine_snapshot_gets_tenant_names_and_totals() -> None:
    state = to_engine_state(
        snapshot(num_prefill_tokens=300, num_cached_tokens=100), {"tn_a": "alpha"}, 7.5
    )
    assert [(t.tenant_id, t.running, t.waiting) for t in state.tenants] == [
        ("tn_a", 2, 0),
        ("tn_b", 1, 3),
        ("tn_c", 0, 1),
    ]
    assert state.tenants[0].tenant_name == "alpha" and state.tenants[1].tenant_name is None
    assert state.num_running == 3 and state.num_waiting == 4 and state.tokens_per_s == 7.5
    assert state.kv_pages_total == 512 and state.kv_pages_free == 100
    assert state.hit_rate == 0.25
    assert to_engine_state(snapshot(), {}, 0.0).hit_rate is None


def test_token_rate_between_polls() -> None:
    rate = TokenRate()
    assert rate.sample(1_000, now=10.0) == 0.0
    assert rate.sample(1_500, now=10.1) == 0.0  # too soon: keeps the last rate
    assert rate.sample(3_000, now=12.0) == 1_000.0
    assert rate.sample(0, now=13.0) == 1_000.0  # counters restarted: re-baseline
    assert rate.sample(500, now=14.0) == 500.0
