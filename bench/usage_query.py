"""Usage at scale: bulk-load usage events with their hourly rollups, then time the admin usage
query and the billing export on SQLite and PostgreSQL (``python -m bench.usage_query``).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import secrets
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from operator import itemgetter
from pathlib import Path
from typing import Any

import msgspec
from litestar import Litestar
from litestar.testing import AsyncTestClient
from sqlalchemy import text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import create_async_engine

from bench.common import DEFAULT_OUT_DIR, emit, quiet_logging
from tenants.billing import BillingService
from tenants.database import Database
from tenants.models import UsageEventRow, UsageRollup
from tenants.price_service import PriceService
from tenants.records import PriceSet, UsageEvent
from tenants.schemas import TenantCreate
from tenants.server_secrets import ensure_admin_token
from tenants.tenant_service import TenantService
from tenants.usage_report import UsageReport
from tenants.usage_store import rollup_rows
from web.admin import admin_router
from web.ops.errors import handle_exception

LIMIT_MS = 200.0
SPAN_START = datetime(2026, 1, 1, tzinfo=UTC)
SPAN_DAYS = 90  # events spread over three months
MONTH = (datetime(2026, 2, 1, tzinfo=UTC), datetime(2026, 3, 1, tzinfo=UTC))
MODELS = ("smollm2-135m", "llama-3-8b", "qwen2-7b")  # the last one stays unpriced
CHUNK = 20_000
EVENT_COLUMNS = tuple(c.name for c in UsageEventRow.__table__.columns)
event_values = itemgetter(*EVENT_COLUMNS)  # an event's fields in the table's column order
ROLLUP_COLUMNS = tuple(c.name for c in UsageRollup.__table__.columns)
RollupSums = dict[tuple[str, str, datetime], list[int]]
Query = Callable[[], Awaitable[int]]


def generate(events: int, tenant_ids: Sequence[str], seed: int = 0) -> Iterator[list[UsageEvent]]:
    """``events`` events in chunks, uniform over tenants, models and ``SPAN_DAYS`` days."""
    rng = random.Random(seed)
    span_ms = SPAN_DAYS * 86_400_000
    for first in range(0, events, CHUNK):
        chunk = []
        for i in range(first, min(first + CHUNK, events)):
            started = SPAN_START + timedelta(milliseconds=rng.randrange(span_ms))
            prompt = rng.randint(1, 4000)
            duration_ms = rng.uniform(50.0, 5000.0)
            chunk.append(
                UsageEvent(
                    request_id=f"bench-{i:09d}",
                    tenant_id=rng.choice(tenant_ids),
                    key_id=None,
                    model=rng.choice(MODELS),
                    prompt_tokens=prompt,
                    cached_tokens=rng.randint(0, prompt),
                    completion_tokens=rng.randint(1, 1000),
                    status="ok",
                    started_at=started,
                    finished_at=started + timedelta(milliseconds=duration_ms),
                    ttft_ms=duration_ms / 10,
                    duration_ms=duration_ms,
                )
            )
        yield chunk


def add_rollups(sums: RollupSums, events: Sequence[UsageEvent]) -> None:
    """Add the meter's hourly rollups of ``events`` into ``sums``."""
    for row in rollup_rows(events):
        acc = sums.setdefault((row["tenant_id"], row["model"], row["hour"]), [0, 0, 0, 0])
        for i, name in enumerate(ROLLUP_COLUMNS[3:]):
            acc[i] += row[name]


def stored(dialect: str, values: Sequence[Any]) -> tuple[Any, ...]:
    """A row as ``UtcDateTime`` stores it: naive UTC datetimes (ISO text on SQLite)."""
    naive = [
        v.astimezone(UTC).replace(tzinfo=None) if isinstance(v, datetime) else v for v in values
    ]
    if dialect == "postgresql":
        return tuple(naive)
    return tuple(v.isoformat(" ", "microseconds") if isinstance(v, datetime) else v for v in naive)


async def write_rows(db: Database, table: str, columns: Sequence[str], rows: list[Any]) -> None:
    """Plain bulk inserts: ``COPY`` on PostgreSQL, one ``executemany`` on SQLite."""
    async with db.engine.connect() as conn:
        if db.dialect == "postgresql":
            driver: Any = (await conn.get_raw_connection()).driver_connection
            await driver.copy_records_to_table(table, records=rows, columns=list(columns))
            return
        marks = ", ".join("?" for _ in columns)
        sql = f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({marks})"
        await conn.exec_driver_sql(sql, rows)
        await conn.commit()


@dataclass(frozen=True, slots=True)
class Loaded:
    tenant_ids: list[str]
    events: int
    rollups: int
    load_s: float


async def bulk_load(db: Database, events: int, tenants: int, seed: int = 0) -> Loaded:
    """Tenants, prices for all models but one, then the events and their rollups."""
    began = time.perf_counter()
    service = TenantService(db)
    created = [await service.create(TenantCreate(name=f"bench-{i:03d}")) for i in range(tenants)]
    tenant_ids = [t.id for t in created]
    prices = PriceService(db)
    for n, model in enumerate(MODELS[:-1], start=1):
        spec = PriceSet(
            input_per_million=n * 100_000,
            cached_input_per_million=n * 10_000,
            output_per_million=n * 400_000,
            effective_from=SPAN_START,
        )
        await prices.set_price(model, spec, actor="bench")
    sums: RollupSums = {}
    for chunk in generate(events, tenant_ids, seed):
        add_rollups(sums, chunk)
        rows = [stored(db.dialect, event_values(msgspec.structs.asdict(e))) for e in chunk]
        await write_rows(db, UsageEventRow.__tablename__, EVENT_COLUMNS, rows)
    rollups = [stored(db.dialect, (*key, *acc)) for key, acc in sorted(sums.items())]
    for first in range(0, len(rollups), CHUNK):
        batch = rollups[first : first + CHUNK]
        await write_rows(db, UsageRollup.__tablename__, ROLLUP_COLUMNS, batch)
    # Fresh planner statistics (and PostgreSQL's visibility map for index-only scans), as
    # autovacuum or SQLite's PRAGMA optimize leave them on a database that has been running.
    async with db.engine.connect() as conn:
        await conn.execution_options(isolation_level="AUTOCOMMIT")
        await conn.execute(text("VACUUM ANALYZE" if db.dialect == "postgresql" else "ANALYZE"))
    return Loaded(tenant_ids, events, len(rollups), time.perf_counter() - began)


def summarize(samples_ms: Sequence[float], rows: int) -> dict[str, Any]:
    """p50 and p95 (nearest rank) of the samples, the row count and the verdict."""
    ordered = sorted(samples_ms)
    p50 = ordered[math.ceil(0.50 * len(ordered)) - 1]
    p95 = ordered[math.ceil(0.95 * len(ordered)) - 1]
    return {"p50_ms": p50, "p95_ms": p95, "rows": rows, "under_limit": p95 < LIMIT_MS}


async def time_query(query: Query, repeat: int) -> dict[str, Any]:
    rows = await query()  # warm-up: caches and prepared statements
    samples = []
    for _ in range(repeat):
        began = time.perf_counter()
        rows = await query()
        samples.append((time.perf_counter() - began) * 1000)
    return summarize(samples, rows)


@asynccontextmanager
async def admin_client(url: str) -> AsyncIterator[AsyncTestClient[Litestar]]:
    """The admin API on the database at ``url``, signed in with a fresh admin token."""
    token = secrets.token_urlsafe(16)

    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        app.state.db = db = await Database.connect(url)
        await ensure_admin_token(db, token)
        try:
            yield
        finally:
            await db.close()

    app = Litestar(
        route_handlers=[admin_router],
        exception_handlers={Exception: handle_exception},
        lifespan=[lifespan],
        logging_config=None,
    )
    async with AsyncTestClient(app) as client:
        client.headers["Authorization"] = f"Bearer {token}"
        yield client


def api_query(client: AsyncTestClient[Litestar]) -> Query:
    """``GET /admin/v1/usage`` by hour for all tenants over ``MONTH``; returns the bucket count."""
    params = {"start": MONTH[0].isoformat(), "end": MONTH[1].isoformat(), "granularity": "hour"}

    async def call() -> int:
        response = await client.get("/admin/v1/usage", params=params)
        response.raise_for_status()
        return response.content.count(b'"tenant_id"')  # one per bucket; no JSON parse timed

    return call


def month_queries(db: Database, tenant_id: str) -> dict[str, Query]:
    """The timed calls of the usage report and billing export, over the month ``MONTH``."""
    report = UsageReport(db)
    billing = BillingService(db, PriceService(db))
    start, end = MONTH

    def usage(granularity: str, tenant: str | None) -> Query:
        async def call() -> int:
            return len(await report.usage(start, end, granularity, tenant_id=tenant))  # type: ignore[arg-type]

        return call

    async def export() -> int:
        return (await billing.billing_export(start, end, "csv"))[1].rows

    return {
        "usage_hour_all_tenants": usage("hour", None),
        "usage_hour_one_tenant": usage("hour", tenant_id),
        "usage_day_all_tenants": usage("day", None),
        "usage_day_one_tenant": usage("day", tenant_id),
        "billing_export_month_csv": export,
    }


@asynccontextmanager
async def scratch_database(url: str, folder: Path) -> AsyncIterator[str]:
    """A fresh, empty database: a new SQLite file, or a new database on the PostgreSQL server
    ``url`` points at (dropped afterwards)."""
    if url == "sqlite" or url.startswith("sqlite"):
        yield f"sqlite+aiosqlite:///{folder / f'usage-{secrets.token_hex(4)}.db'}"
        return
    parsed = make_url(url)
    name = f"atrium_bench_{secrets.token_hex(4)}"
    admin = create_async_engine(parsed, isolation_level="AUTOCOMMIT")
    try:
        async with admin.connect() as conn:
            await conn.execute(text(f'CREATE DATABASE "{name}"'))
        yield parsed.set(database=name).render_as_string(hide_password=False)
    finally:
        async with admin.connect() as conn:
            await conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        await admin.dispose()


async def load_and_time(url: str, events: int, tenants: int, repeat: int) -> dict[str, Any]:
    """Load a fresh database, then time each query on the service and once through the API."""
    db = await Database.connect(url)
    try:
        await db.upgrade()
        loaded = await bulk_load(db, events, tenants)
        queries = month_queries(db, loaded.tenant_ids[0])
        timings = {name: await time_query(query, repeat) for name, query in queries.items()}
    finally:
        await db.close()
    async with admin_client(url) as client:
        timings["admin_api_usage_hour_all_tenants"] = await time_query(api_query(client), repeat)
    return {
        "backend": db.dialect,
        "events": loaded.events,
        "rollup_rows": loaded.rollups,
        "tenants": len(loaded.tenant_ids),
        "load_s": loaded.load_s,
        "queries": timings,
    }


def run_backend(url: str, folder: Path, events: int, tenants: int, repeat: int) -> dict[str, Any]:
    """One backend's results, on a scratch database made for the run (see ``scratch_database``)."""

    async def run() -> dict[str, Any]:
        async with scratch_database(url, folder) as scratch:
            return await load_and_time(scratch, events, tenants, repeat)

    return asyncio.run(run())


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.usage_query", description=__doc__)
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--tenants", type=int, default=20)
    parser.add_argument("--repeat", type=int, default=20, help="timed calls per query")
    parser.add_argument(
        "--database-url",
        action="append",
        dest="urls",
        help="repeatable: 'sqlite' (the default) or a PostgreSQL URL (see scratch_database)",
    )
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR)
    args = parser.parse_args(argv)
    quiet_logging()
    backends = []
    with tempfile.TemporaryDirectory(prefix="atrium-usage-bench-") as folder:
        for url in args.urls or ["sqlite"]:
            backends.append(run_backend(url, Path(folder), args.events, args.tenants, args.repeat))
    # The load average puts the timings in context: a busy machine stretches every p95.
    result = {"limit_ms": LIMIT_MS, "load_average_1m": os.getloadavg()[0], "backends": backends}
    emit(result, args.out_dir, "usage_query")
    ok = all(q["under_limit"] for b in backends for n, q in b["queries"].items() if "usage" in n)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
