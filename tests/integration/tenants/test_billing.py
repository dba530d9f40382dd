"""Billing export and usage buckets: totals, per-request prices, determinism."""

from __future__ import annotations

import asyncio
import csv
import hashlib
import io
import itertools
from datetime import timedelta

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tenants.billing_render import cost_numerator, round_micros
from tenants.records import BillingRow, PriceSet, UsageEvent
from tenants.schemas import TenantCreate
from tenants.usage_store import UsageStore

PRICE = PriceSet(
    input_per_million=2_000_000, cached_input_per_million=500_000, output_per_million=8_000_000
)
LATER_PRICE = PriceSet(
    input_per_million=4_000_000, cached_input_per_million=1_000_000, output_per_million=16_000_000
)


def _event(rid: str, tenant: str, model: str, at, prompt: int, cached: int, completion: int):
    return UsageEvent(
        request_id=rid,
        tenant_id=tenant,
        key_id=None,
        model=model,
        prompt_tokens=prompt,
        cached_tokens=cached,
        completion_tokens=completion,
        status="ok",
        started_at=at,
        finished_at=at + timedelta(seconds=1),
    )


def test_price_change_mid_window_is_applied_per_request(open_domain, clock) -> None:
    t0 = clock()

    async def body() -> None:
        async with open_domain() as domain:
            tenant = await domain.tenants.create(TenantCreate(name="acme"))
            await domain.prices.set_price("m", msgspec.structs.replace(PRICE, effective_from=t0))
            await domain.prices.set_price(
                "m", msgspec.structs.replace(LATER_PRICE, effective_from=t0 + timedelta(hours=1))
            )
            await UsageStore(domain.db).write(
                [
                    _event("a", tenant.id, "m", t0 + timedelta(minutes=30), 1000, 400, 500),
                    _event("b", tenant.id, "m", t0 + timedelta(minutes=90), 1000, 400, 500),
                    _event("late", tenant.id, "m", t0 + timedelta(hours=3), 9, 0, 9),  # outside
                ]
            )
            data, manifest = await domain.billing.billing_export(t0, t0 + timedelta(hours=2))
            rows = list(csv.DictReader(io.StringIO(data.decode())))
            assert rows == [
                {
                    "tenant_id": tenant.id,
                    "tenant_name": "acme",
                    "model": "m",
                    "requests": "2",
                    "prompt_tokens": "2000",
                    "cached_tokens": "800",
                    "completion_tokens": "1000",
                    "cost": "0.016200",
                    "cost_micros": "16200",
                    "currency": "USD",
                }
            ]  # 5400 at the first price + 10800 at the second
            assert manifest.cost_micros == {"USD": 16200} and manifest.rows == 1
            jsonl, _ = await domain.billing.billing_export(t0, t0 + timedelta(hours=2), "jsonl")
            decoded = [msgspec.json.decode(line, type=BillingRow) for line in jsonl.splitlines()]
            assert [r.cost_micros for r in decoded] == [16200]

    asyncio.run(body())


def test_usage_buckets_by_hour_and_day(open_domain, clock) -> None:
    t0 = clock().replace(hour=0)

    async def body() -> None:
        async with open_domain() as domain:
            await UsageStore(domain.db).write(
                [
                    _event("a", "tn_a", "m1", t0 + timedelta(minutes=5), 10, 2, 1),
                    _event("b", "tn_a", "m2", t0 + timedelta(minutes=50), 20, 0, 2),
                    _event("c", "tn_a", "m1", t0 + timedelta(hours=5), 30, 3, 3),
                    _event("d", "tn_b", "m1", t0 + timedelta(days=1), 40, 4, 4),
                ]
            )
            end = t0 + timedelta(days=2)
            hours = await domain.reports.usage(t0, end, "hour", tenant_id="tn_a")
            assert [
                (b.start - t0, b.requests, b.prompt_tokens, b.cached_tokens, b.completion_tokens)
                for b in hours
            ] == [(timedelta(0), 2, 30, 2, 3), (timedelta(hours=5), 1, 30, 3, 3)]
            days = await domain.reports.usage(t0, end, "day")
            assert [(b.tenant_id, b.start - t0, b.requests) for b in days] == [
                ("tn_a", timedelta(0), 3),
                ("tn_b", timedelta(days=1), 1),
            ]

    asyncio.run(body())


EVENTS = st.lists(
    st.tuples(
        st.integers(0, 2),  # tenant
        st.sampled_from(["priced", "unpriced"]),
        st.integers(0, 3 * 24 * 60 - 1),  # minute within a three-day window
        st.integers(0, 50_000),  # prompt tokens
        st.floats(0, 1),  # cached share of the prompt
        st.integers(0, 20_000),  # completion tokens
    ),
    max_size=40,
)


@settings(
    max_examples=6,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(drawn=EVENTS)
def test_export_totals_equal_the_sums_of_random_events(open_domain, clock, drawn) -> None:
    example = next(_examples)
    start = clock() + timedelta(days=10 * example)  # each example has a window of its own
    end = start + timedelta(days=3)

    async def body() -> None:
        async with open_domain() as domain:
            await domain.prices.set_price(  # the same instant again only replaces it
                "priced", msgspec.structs.replace(PRICE, effective_from=clock())
            )
            tenants = [
                (await domain.tenants.create(TenantCreate(name=f"t{example}-{i}"))).id
                for i in range(3)
            ]
            events = [
                _event(
                    f"{example}-{n}",
                    tenants[t],
                    model,
                    start + timedelta(minutes=minute),
                    prompt,
                    int(prompt * share),
                    completion,
                )
                for n, (t, model, minute, prompt, share, completion) in enumerate(drawn)
            ]
            await UsageStore(domain.db).write(events)
            data, manifest = await domain.billing.billing_export(start, end)
            again, _ = await domain.billing.billing_export(start, end)
            assert data == again
            assert manifest.sha256 == hashlib.sha256(data).hexdigest()
            assert manifest.requests == len(events)
            assert manifest.prompt_tokens == sum(e.prompt_tokens for e in events)
            assert manifest.cached_tokens == sum(e.cached_tokens for e in events)
            assert manifest.completion_tokens == sum(e.completion_tokens for e in events)
            assert manifest.unpriced_requests == sum(e.model == "unpriced" for e in events)
            price = (await domain.prices.list_prices("priced"))[0]
            expected: dict[tuple[str, str], int] = {}
            for e in events:
                key = (e.tenant_id, e.model)
                num = cost_numerator(price, e.prompt_tokens, e.cached_tokens, e.completion_tokens)
                expected[key] = expected.get(key, 0) + (num if e.model == "priced" else 0)
            rows = list(csv.DictReader(io.StringIO(data.decode())))
            assert manifest.rows == len(rows) == len(expected)
            got = {(r["tenant_id"], r["model"]): int(r["cost_micros"]) for r in rows}
            assert got == {k: round_micros(v) for k, v in expected.items()}

    asyncio.run(body())


_examples = itertools.count()
