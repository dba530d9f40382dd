"""Batches in SQL: two gateways claim a batch's lines concurrently and never share one; a dead
gateway's claims are taken again once its lease expires; a lost claim cannot store a result;
and tenants see only their own batches."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import msgspec
import pytest
from sqlalchemy import select

from tenants import TenantDomain
from tenants.batch_files import FileService
from tenants.batch_store import BatchStore, ClaimedLine, batch_of_request, line_request_id
from tenants.errors import ConflictError, NotFoundError
from tenants.models import TokenBudget, UsageEventRow
from tenants.records import PriceSet
from tenants.schemas import Quotas, TenantCreate, Usage
from tests.integration.tenants.conftest import FakeClock, OpenDomain

LINES = 40
CHAT = "/v1/chat/completions"


def _jsonl(count: int, url: str = CHAT) -> bytes:
    lines = [
        {"custom_id": f"req-{n}", "method": "POST", "url": url, "body": {"model": "m"}}
        for n in range(count)
    ]
    return b"".join(msgspec.json.encode(line) + b"\n" for line in lines)


async def _batch(domain: TenantDomain, clock: FakeClock, count: int) -> tuple[BatchStore, str]:
    tenant = await domain.tenants.create(TenantCreate(name="acme"))
    info, _ = await domain.keys.create_key(tenant.id)
    files = FileService(domain.db, clock)
    upload = await files.upload(tenant.id, "in.jsonl", _jsonl(count), max_lines=100)
    store = BatchStore(domain.db, clock)
    batch = await store.create(
        tenant.id, info.id, input_file_id=upload.id, endpoint=CHAT, completion_window="24h",
        max_lines=100,
    )  # fmt: skip
    assert await store.set_status(batch.id, "validating", "in_progress")
    return store, batch.id


async def _drain(store: BatchStore, lease_id: str) -> list[ClaimedLine]:
    taken: list[ClaimedLine] = []
    while claims := await store.claim(lease_id, 3):
        taken += claims
        await asyncio.sleep(0)
    return taken


def test_two_gateways_never_claim_the_same_line(open_domain: OpenDomain, clock: FakeClock) -> None:
    async def scenario() -> None:
        async with open_domain() as domain:
            store, batch_id = await _batch(domain, clock, LINES)
            a = await domain.leases.acquire(60.0)
            b = await domain.leases.acquire(60.0)
            first, second = await asyncio.gather(_drain(store, a), _drain(store, b))
            lines = [c.line for c in first] + [c.line for c in second]
            assert sorted(lines) == list(range(LINES))  # each line once, none left out
            # Each claim is its claimer's (which one wins a race for the first lines is up to
            # the database's scheduling: one gateway may take them all).
            assert all(c.lease_id == a for c in first) and all(c.lease_id == b for c in second)
            info = await store.get((first or second)[0].tenant_id, batch_id)
            assert info.request_counts.total == LINES

    asyncio.run(scenario())


def test_a_dead_gateways_claims_are_taken_again_and_its_late_result_refused(
    open_domain: OpenDomain, clock: FakeClock
) -> None:
    async def scenario() -> None:
        async with open_domain() as domain:
            store, batch_id = await _batch(domain, clock, 3)
            dead = await domain.leases.acquire(10.0)
            claimed = await store.claim(dead, 3)
            live = await domain.leases.acquire(60.0)
            assert await store.claim(live, 3) == []  # held by a live lease
            clock.advance(11.0)
            live_after = await domain.leases.acquire(60.0)
            retaken = await store.claim(live_after, 3)
            assert [c.line for c in retaken] == [0, 1, 2]
            assert all(c.attempt == 2 for c in retaken)
            ok = {"response": {"status_code": 200}}
            assert not await store.finish_line(claimed[0], "completed", ok)  # claim lost
            assert await store.finish_line(retaken[0], "completed", ok)
            assert await store.retry_line(retaken[1], 30.0)
            assert await store.claim(live_after, 3) == []  # not before 30 s
            clock.advance(31.0)
            assert [c.line for c in await store.claim(live_after, 3)] == [1]
            counts = (await store.get(retaken[0].tenant_id, batch_id)).request_counts
            assert (counts.total, counts.completed, counts.failed) == (3, 1, 0)

    asyncio.run(scenario())


def test_cancel_and_tenant_isolation(open_domain: OpenDomain, clock: FakeClock) -> None:
    async def scenario() -> None:
        async with open_domain() as domain:
            store, batch_id = await _batch(domain, clock, 2)
            other = await domain.tenants.create(TenantCreate(name="other"))
            with pytest.raises(NotFoundError):
                await store.get(other.id, batch_id)
            with pytest.raises(NotFoundError):
                await store.cancel(other.id, batch_id)
            tenant_id = (await store.batches_in(["in_progress"]))[0].tenant_id
            assert (await store.cancel(tenant_id, batch_id)).status == "cancelling"
            with pytest.raises(ConflictError):
                await store.cancel(tenant_id, batch_id)
            lease = await domain.leases.acquire(60.0)
            assert await store.claim(lease, 5) == []  # a cancelling batch starts no line

    asyncio.run(scenario())


def test_lines_a_gateway_holds_but_no_longer_runs_go_back(
    open_domain: OpenDomain, clock: FakeClock
) -> None:
    async def scenario() -> None:
        async with open_domain() as domain:
            store, _ = await _batch(domain, clock, 2)
            lease = await domain.leases.acquire(60.0)
            first, second = await store.claim(lease, 2)
            keep = {(second.batch_id, second.line)}
            assert await store.release_orphans(lease, keep) == 1
            again = await store.claim(lease, 2)
            assert [(c.line, c.attempt) for c in again] == [(first.line, 2)]
            assert not await store.finish_line(first, "completed", {})  # its old claim is void

    asyncio.run(scenario())


def test_a_line_lost_with_its_gateway_is_metered_as_a_batch_line(
    open_domain: OpenDomain, clock: FakeClock
) -> None:
    async def scenario() -> None:
        async with open_domain() as domain:
            store, batch_id = await _batch(domain, clock, 1)
            dead = await domain.leases.acquire(10.0)
            (claim,) = await store.claim(dead, 1)
            ctx = await store.context_of(claim.tenant_id, claim.key_id)
            request_id = line_request_id(batch_id, claim.line, claim.attempt)
            await domain.admission.admit(ctx, request_id, 30, 10, model="m", lease_id=dead)
            clock.advance(11.0)
            assert await domain.leases.reclaim() == 1
            async with domain.db.sessions() as session:
                event = await session.get(UsageEventRow, request_id)
            assert event is not None and event.status == "gateway_lost"
            assert event.batch_id == batch_id  # priced at the batch discount
            assert batch_of_request("chatcmpl-0123") is None

    asyncio.run(scenario())


def test_a_batch_lines_money_is_charged_at_the_discount(
    open_domain: OpenDomain, clock: FakeClock
) -> None:
    async def scenario() -> None:
        async with open_domain() as domain:
            price = PriceSet(
                input_per_million=2_000_000, cached_input_per_million=500_000,
                output_per_million=8_000_000, batch_discount_percent=50,
                effective_from=clock.now - timedelta(days=1),
            )  # fmt: skip
            await domain.prices.set_price("m", price)
            quotas = Quotas(monthly_cost_budget=1_000_000)
            tenant = await domain.tenants.create(TenantCreate(name="acme", quotas=quotas))
            _, secret = await domain.keys.create_key(tenant.id)
            ctx = await domain.keys.authenticate(secret)
            usage = Usage(prompt_tokens=1000, completion_tokens=1000)  # 2,000 + 8,000 in full
            for request_id in ("chatcmpl-1", line_request_id("batch_ab", 0, 1)):
                admitted = await domain.admission.admit(ctx, request_id, 1000, 1000, model="m")
                assert await domain.admission.settle(admitted, usage)
            async with domain.db.sessions() as session:
                budget = await session.scalar(select(TokenBudget))
            assert budget is not None and budget.cost_used == 10_000 + 5_000

    asyncio.run(scenario())
