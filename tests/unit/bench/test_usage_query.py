"""The usage benchmark at a tiny size: its generator, bulk loader, rollups and timing summary."""

from __future__ import annotations

import asyncio
from collections import Counter
from datetime import timedelta
from pathlib import Path

from sqlalchemy import func, select

from bench.usage_query import (
    LIMIT_MS,
    MODELS,
    MONTH,
    SPAN_DAYS,
    SPAN_START,
    RollupSums,
    add_rollups,
    bulk_load,
    generate,
    run_backend,
    summarize,
)
from tenants.database import Database
from tenants.models import UsageEventRow, UsageRollup
from tenants.usage_report import UsageReport
from tenants.usage_store import rollup_rows


def test_generate_spreads_events_over_tenants_models_and_three_months() -> None:
    events = [e for chunk in generate(600, ["ta", "tb", "tc"], seed=3) for e in chunk]
    assert len(events) == 600
    assert len({e.request_id for e in events}) == 600
    assert set(Counter(e.tenant_id for e in events)) == {"ta", "tb", "tc"}
    assert set(Counter(e.model for e in events)) == set(MODELS)
    end = SPAN_START + timedelta(days=SPAN_DAYS)
    assert all(SPAN_START <= e.started_at < end for e in events)
    assert {e.started_at.month for e in events} == {1, 2, 3}
    assert all(e.cached_tokens <= e.prompt_tokens for e in events)
    again = [e for chunk in generate(600, ["ta", "tb", "tc"], seed=3) for e in chunk]
    assert again == events


def test_rollups_added_chunk_by_chunk_equal_one_batch() -> None:
    events = next(generate(400, ["ta", "tb"], seed=1))
    sums: RollupSums = {}
    add_rollups(sums, events[:150])
    add_rollups(sums, events[150:])
    whole = {
        (r["tenant_id"], r["model"], r["hour"]): [
            r["requests"],
            r["prompt_tokens"],
            r["cached_tokens"],
            r["completion_tokens"],
        ]
        for r in rollup_rows(events)
    }
    assert sums == whole


def test_summarize_takes_nearest_rank_percentiles_and_judges_the_p95() -> None:
    fast = summarize([float(ms) for ms in range(100, 0, -1)], rows=7)
    assert (fast["p50_ms"], fast["p95_ms"], fast["rows"]) == (50.0, 95.0, 7)
    assert fast["under_limit"] is True
    slow = summarize([10.0] * 18 + [LIMIT_MS + 1, LIMIT_MS + 5], rows=1)
    assert slow["p50_ms"] == 10.0 and slow["p95_ms"] == LIMIT_MS + 1
    assert slow["under_limit"] is False


def test_bulk_load_stores_every_event_once_with_matching_rollups(tmp_path: Path) -> None:
    async def body() -> None:
        db = await Database.connect(f"sqlite+aiosqlite:///{tmp_path / 'bench.db'}")
        try:
            await db.upgrade()
            loaded = await bulk_load(db, 500, tenants=3, seed=2)
            async with db.sessions() as session:
                events = await session.scalar(select(func.count()).select_from(UsageEventRow))
                prompt = await session.scalar(select(func.sum(UsageEventRow.prompt_tokens)))
                requests = await session.scalar(select(func.sum(UsageRollup.requests)))
                rollups = await session.scalar(select(func.count()).select_from(UsageRollup))
            assert (events, requests, rollups) == (500, 500, loaded.rollups)
            start, end = SPAN_START, SPAN_START + timedelta(days=SPAN_DAYS)
            days = await UsageReport(db).usage(start, end, "day")
            assert sum(b.requests for b in days) == 500
            assert sum(b.prompt_tokens for b in days) == prompt
            assert {b.tenant_id for b in days} == set(loaded.tenant_ids)
        finally:
            await db.close()

    asyncio.run(body())


def test_run_backend_times_each_query_and_the_admin_api(tmp_path: Path) -> None:
    result = run_backend("sqlite", tmp_path, events=300, tenants=2, repeat=2)
    assert (result["backend"], result["events"], result["tenants"]) == ("sqlite", 300, 2)
    queries = result["queries"]
    assert set(queries) == {
        "usage_hour_all_tenants",
        "usage_hour_one_tenant",
        "usage_day_all_tenants",
        "usage_day_one_tenant",
        "billing_export_month_csv",
        "admin_api_usage_hour_all_tenants",
    }
    for timing in queries.values():
        assert 0 < timing["p50_ms"] <= timing["p95_ms"]
    # The API returns what the service returns; one tenant sees a part of all tenants' buckets.
    hour_all = queries["usage_hour_all_tenants"]["rows"]
    assert queries["admin_api_usage_hour_all_tenants"]["rows"] == hour_all > 0
    assert 0 < queries["usage_hour_one_tenant"]["rows"] < hour_all
    assert 0 < queries["usage_day_one_tenant"]["rows"] < queries["usage_day_all_tenants"]["rows"]
    assert queries["usage_day_all_tenants"]["rows"] <= 2 * (MONTH[1] - MONTH[0]).days
    assert queries["billing_export_month_csv"]["rows"] == 2 * len(MODELS)
