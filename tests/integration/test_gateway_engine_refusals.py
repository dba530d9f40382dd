"""Refusals before any token is computed cost nothing: the engine's 400 (a prompt larger than the
KV cache) and 503 (engine dead) are recorded with their status and zero tokens, the budget
reservation and the concurrency slot released; a prompt over the KV cache is refused at admission.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from litestar.testing import TestClient
from sqlalchemy import select

from engine.errors import EngineDeadError, EngineError, PromptTooLongError
from engine.outputs import GenerateRequest, RequestOutput
from tenants import Database, TenantDomain
from tenants.models import UsageEventRow
from tenants.schemas import Quotas
from tests.integration.gateway_fakes import MODEL, make_runtime, settings
from tests.integration.pg_gateway import Books, create_tenant, migrated_database, read_books
from tests.support.postgres import migrate
from web.app import create_app

BUDGET = 1000
PROMPT = {"model": MODEL, "prompt": "a prompt of several tokens", "max_tokens": 4}


@dataclass
class RefusingEngine:
    """Refuses every request with ``error`` before producing anything."""

    error: EngineError
    calls: list[str] = field(default_factory=list)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        self.calls.append(request.request_id)
        raise self.error
        yield  # pragma: no cover (makes this an async generator)

    def abort(self, request_id: str) -> None:
        pass


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        url = f"sqlite+aiosqlite:///{tmp_path / 'atrium.db'}"
        asyncio.run(migrate(url))
        yield url
        return
    with migrated_database() as name:
        yield f"postgresql+asyncpg://postgres@127.0.0.1:5432/{name}"


def _gateway(
    url: str, tmp_path: Path, tiny_llama_dir: Path, engine: Any, capacity: int | None = None
) -> tuple[TestClient[Any], dict[str, str]]:
    quotas = Quotas(max_concurrent_requests=1, monthly_token_budget=BUDGET)
    (key,) = asyncio.run(create_tenant(url, tmp_path / "seed.spool", "refused", quotas, 1))
    runtime, _ = make_runtime(tiny_llama_dir)
    runtime.engine = engine
    runtime.kv_capacity_tokens = capacity
    config = settings(database_url=url, usage_spool_path=str(tmp_path / "usage.spool"))
    client = TestClient(create_app(config, engine=runtime, include_admin=False))
    return client, {"Authorization": f"Bearer {key}"}


async def _events(url: str) -> list[tuple[str, str, int, int]]:
    db = await Database.connect(url)
    try:
        async with db.sessions() as session:
            rows = await session.execute(
                select(
                    UsageEventRow.request_id,
                    UsageEventRow.status,
                    UsageEventRow.prompt_tokens,
                    UsageEventRow.completion_tokens,
                )
            )
            return [(r[0], r[1], int(r[2]), int(r[3])) for r in rows]
    finally:
        await db.close()


async def _billed_prompt_tokens(url: str, spool: Path) -> int:
    db = await Database.connect(url)
    domain = await TenantDomain.open(db, spool_path=spool)
    try:
        now = datetime.now(UTC)
        start, end = now - timedelta(days=1), now + timedelta(days=1)
        _, manifest = await domain.billing.billing_export(start, end, "jsonl")
        return manifest.prompt_tokens
    finally:
        await domain.close()


def _assert_nothing_held(books: Books) -> None:
    assert (books.budget_used, books.budget_reserved) == (0, 0)
    assert books.reservations == 0 and books.in_flight == 0


@pytest.mark.parametrize(
    ("error", "status", "code", "event_status"),
    [
        (
            PromptTooLongError("prompt (7 tokens) exceeds the KV cache (4 tokens)", "prompt"),
            400,
            "context_length_exceeded",
            "rejected",
        ),
        (EngineDeadError("the engine loop stopped"), 503, "engine_dead", "unavailable"),
    ],
)
def test_an_engine_refusal_is_recorded_and_costs_nothing(
    database_url: str,
    tmp_path: Path,
    tiny_llama_dir: Path,
    error: EngineError,
    status: int,
    code: str,
    event_status: str,
) -> None:
    engine = RefusingEngine(error)
    client, auth = _gateway(database_url, tmp_path, tiny_llama_dir, engine)
    with client:
        for _ in range(2):  # the slot (max_concurrent_requests=1) came back after the first
            refused = client.post("/v1/completions", json=PROMPT, headers=auth)
            assert refused.status_code == status, refused.text
            assert refused.json()["error"]["code"] == code
    assert len(engine.calls) == 2
    events = asyncio.run(_events(database_url))
    assert sorted(events) == sorted((rid, event_status, 0, 0) for rid in engine.calls)
    _assert_nothing_held(asyncio.run(read_books(database_url)))
    assert asyncio.run(_billed_prompt_tokens(database_url, tmp_path / "bill.spool")) == 0


def test_a_prompt_over_the_kv_cache_is_refused_at_admission(
    database_url: str, tmp_path: Path, tiny_llama_dir: Path
) -> None:
    engine = RefusingEngine(EngineDeadError("never reached"))
    client, auth = _gateway(database_url, tmp_path, tiny_llama_dir, engine, capacity=3)
    with client:
        refused = client.post("/v1/completions", json=PROMPT, headers=auth)
    assert refused.status_code == 400
    body = refused.json()["error"]
    assert body["code"] == "context_length_exceeded" and body["param"] == "prompt"
    assert "KV cache" in body["message"]
    assert engine.calls == []
    assert asyncio.run(_events(database_url)) == []
    _assert_nothing_held(asyncio.run(read_books(database_url)))
