"""`kill -9` of a gateway mid-stream locks nobody out and loses no usage: its lease expires, the
next gateway frees the slot and the reservation and writes the request's one usage event, with
the output tokens the dead gateway had checkpointed on the reservation."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from sqlalchemy import select

from tenants import Database
from tenants.models import Reservation, UsageEventRow
from tenants.schemas import Quotas
from tests.integration.gateway_fakes import MODEL
from tests.integration.gateway_process import started_gateway
from tests.integration.pg_gateway import create_tenant, migrated_database, read_books
from tests.support.postgres import migrate, pg_url

pytestmark = pytest.mark.slow
LEASE_S = 1.5
CHECKPOINT_S = 0.2
MAX_TOKENS = 200
STREAM = {"model": MODEL, "prompt": "a long story", "max_tokens": MAX_TOKENS, "stream": True}
SHORT = {"model": MODEL, "prompt": "hi", "max_tokens": 2}


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        url = f"sqlite+aiosqlite:///{tmp_path / 'atrium.db'}"
        asyncio.run(migrate(url))
        yield url
        return
    with migrated_database() as name:
        yield pg_url(name)


@contextmanager
def _gateway(
    model: Path, url: str, tmp: Path, name: str
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    env = {"ATRIUM_GATEWAY_LEASE_S": str(LEASE_S), "ATRIUM_USAGE_CHECKPOINT_S": str(CHECKPOINT_S)}
    with started_gateway(model, url, tmp, name, env=env) as started:
        yield started


async def _events_of(url: str, request_id: str) -> list[tuple[str, int, int]]:
    db = await Database.connect(url)
    try:
        async with db.sessions() as session:
            rows = await session.execute(
                select(
                    UsageEventRow.status,
                    UsageEventRow.prompt_tokens,
                    UsageEventRow.completion_tokens,
                ).where(UsageEventRow.request_id == request_id)
            )
            return [(r[0], int(r[1]), int(r[2])) for r in rows]
    finally:
        await db.close()


async def _checkpointed(url: str, request_id: str) -> int:
    """The output tokens last checkpointed on the request's reservation (0: none yet)."""
    db = await Database.connect(url)
    try:
        async with db.sessions() as session:
            tokens = await session.scalar(
                select(Reservation.completion_tokens).where(Reservation.request_id == request_id)
            )
            return int(tokens or 0)
    finally:
        await db.close()


def test_a_killed_gateway_frees_the_tenant_within_the_lease_and_meters_once(
    database_url: str, tmp_path: Path, tiny_llama_dir: Path
) -> None:
    quotas = Quotas(max_concurrent_requests=1, monthly_token_budget=100_000)
    (key,) = asyncio.run(create_tenant(database_url, tmp_path / "seed.spool", "crash", quotas, 1))
    auth = {"Authorization": f"Bearer {key}"}

    with (
        _gateway(tiny_llama_dir, database_url, tmp_path, "first") as (base, proc),
        httpx.stream("POST", base + "/v1/completions", json=STREAM, headers=auth) as stream,
    ):
        assert stream.status_code == 200
        killed = stream.headers["x-request-id"]
        chunks = stream.iter_lines()
        assert sum(1 for line, _ in zip(chunks, range(6), strict=False) if line) >= 3
        deadline = time.monotonic() + 10
        while (checkpointed := asyncio.run(_checkpointed(database_url, killed))) < 3:
            assert time.monotonic() < deadline, "no output checkpointed on the reservation"
            next(chunks)  # keep reading, so the stream goes on
        proc.send_signal(signal.SIGKILL)  # mid-stream: no drain, no settle
        proc.wait()
        killed_at = time.monotonic()

    with _gateway(tiny_llama_dir, database_url, tmp_path, "second") as (base, _):
        ready_at = time.monotonic()  # a restart's own time depends on the machine's load
        while True:
            served = httpx.post(base + "/v1/completions", json=SHORT, headers=auth, timeout=10)
            if served.status_code == 200:
                break
            assert served.status_code == 429, served.text  # the dead gateway's slot, for now
            assert time.monotonic() - ready_at < 20, "the tenant is still locked out"
            time.sleep(0.1)
        waited = time.monotonic() - ready_at
        served_id = served.headers["x-request-id"]
        books = asyncio.run(read_books(database_url))
        assert books.reservations == 0 and books.in_flight == 0  # the served one settled too

    # Within the lease (1.5 s) and one renewal interval of the reclaimer, once restarted.
    assert waited < 10, (waited, ready_at - killed_at)
    (status, prompt_tokens, completion_tokens), *more = asyncio.run(
        _events_of(database_url, killed)
    )
    assert more == []
    # Billed the prompt and the output delivered up to the last checkpoint before the kill.
    assert status == "gateway_lost" and prompt_tokens > 0
    assert checkpointed <= completion_tokens < MAX_TOKENS
    (_, short_prompt, short_completion), *_ = asyncio.run(_events_of(database_url, served_id))
    books = asyncio.run(read_books(database_url))
    assert books.budget_used == prompt_tokens + completion_tokens + short_prompt + short_completion
    assert books.budget_reserved == 0 and books.in_flight == 0 and books.reservations == 0
    assert len(books.request_ids) == 2  # the killed request and the one served after
