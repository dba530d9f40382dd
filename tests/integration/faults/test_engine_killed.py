"""The engine process dies: `kill -9` mid-stream, or an error mid-request. The stream ends with an
error, the request is metered once with the tokens it delivered, its slot and reservation are
freed, and later requests get 503 `engine_dead` and cost nothing."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from litestar.testing import TestClient
from sqlalchemy import select

from engine.errors import EngineError
from engine.outputs import GenerateRequest, RequestOutput
from engine.tokenizer import Tokenizer
from tenants import Database
from tenants.models import UsageEventRow
from tenants.schemas import Quotas
from tests.integration.gateway_fakes import settings
from tests.integration.pg_gateway import ADMIN_TOKEN, create_tenant, read_books
from tests.integration.test_admin_app import migrated_sqlite
from web.app import create_app
from web.openai.generation import ModelRuntime

pytestmark = pytest.mark.slow
QUOTAS = Quotas(max_concurrent_requests=1, monthly_token_budget=100_000)


async def usage_rows(url: str) -> dict[str, tuple[str, int, int]]:
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
            return {r[0]: (r[1], int(r[2]), int(r[3])) for r in rows}
    finally:
        await db.close()


@pytest.fixture
def gateway(tiny_llama_dir: Path, tmp_path: Path) -> Iterator[tuple[Any, dict[str, str], str]]:
    url = migrated_sqlite(tmp_path / "atrium.db")
    (key,) = asyncio.run(create_tenant(url, tmp_path / "seed.spool", "engine", QUOTAS, 1))
    config = settings(
        model=str(tiny_llama_dir),
        dtype="float32",
        device="cpu",
        kv_cache_bytes=8 * 2**20,
        database_url=url,
        admin_token=ADMIN_TOKEN,
        usage_spool_path=str(tmp_path / "usage.spool"),
        torch_threads=1,
    )
    with TestClient(create_app(config, include_admin=False)) as client:
        yield client, {"Authorization": f"Bearer {key}"}, url


def test_engine_killed_mid_stream_meters_what_was_delivered_once(
    gateway: tuple[Any, dict[str, str], str],
) -> None:
    client, auth, url = gateway
    engine = client.app.state.engine
    model = client.get("/v1/models", headers=auth).json()["data"][0]["id"]
    body = {
        "model": model,
        "prompt": "a long story",
        "max_tokens": 1000,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    service = client.app.state.generation

    def kill_after_a_few_tokens() -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            jobs = list(service.active.values())
            if jobs and jobs[0].completion_tokens >= 3:
                os.kill(engine.pid, signal.SIGKILL)  # mid-stream: the child just vanishes
                return
            time.sleep(0.002)

    killer = threading.Thread(target=kill_after_a_few_tokens)
    killer.start()
    response = client.post("/v1/completions", json=body, headers=auth)
    killer.join()
    assert response.status_code == 200
    killed = response.headers["x-request-id"]
    frames = [f.removeprefix("data: ") for f in response.text.split("\n\n") if f.strip()]
    assert frames[-1] == "[DONE]"
    chunks = [json.loads(f) for f in frames[:-1]]
    delivered = sum(1 for c in chunks if c.get("choices") and c["choices"][0].get("text"))
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")]
    assert "error" in finishes or any("error" in c for c in chunks), chunks[-2:]
    usage = chunks[-1]["usage"]
    assert 3 <= usage["completion_tokens"] < 1000

    # The tenant's one slot is free again: the next request is refused by the dead engine
    # (503), not by its concurrency quota (429), and costs nothing.
    after = client.post(
        "/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 2}, headers=auth
    )
    assert after.status_code == 503 and after.json()["error"]["code"] == "engine_dead"
    assert client.get("/readyz").status_code == 503

    client.blocking_portal.call(client.app.state.tenancy._meter.flush)
    rows = asyncio.run(usage_rows(url))
    assert len(rows) == 2
    status, prompt_tokens, completion_tokens = rows.pop(killed)
    assert status == "error"
    assert (prompt_tokens, completion_tokens) == (
        usage["prompt_tokens"],
        usage["completion_tokens"],
    )
    assert completion_tokens >= delivered
    ((refused_status, *refused_tokens),) = rows.values()
    assert refused_status == "unavailable" and refused_tokens == [0, 0]
    books = asyncio.run(read_books(url))
    assert books.budget_used == usage["total_tokens"]
    assert (books.budget_reserved, books.reservations, books.in_flight) == (0, 0, 0)


class FailingEngine:
    """Five tokens, then the engine fails the request: by raising, or with an error output."""

    def __init__(self, tokenizer: Tokenizer, raises: bool) -> None:
        self.tokenizer = tokenizer
        self.raises = raises

    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        token = self.tokenizer.encode("a")[0]
        for n in range(1, 6):
            yield RequestOutput(
                request_id=request.request_id,
                token_ids=[token],
                text="a",
                num_prompt_tokens=len(request.prompt_token_ids),
                num_output_tokens=n,
            )
        if self.raises:
            raise EngineError("the step failed")
        yield RequestOutput(
            request_id=request.request_id,
            finished=True,
            finish_reason="error",
            error="the step failed",
            num_prompt_tokens=len(request.prompt_token_ids),
            num_output_tokens=5,
        )

    def abort(self, request_id: str) -> None:
        pass


@pytest.mark.parametrize("raises", [True, False], ids=["raised", "error_output"])
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_an_engine_error_mid_request_meters_the_tokens_computed_once(
    tiny_llama_dir: Path, tmp_path: Path, raises: bool, stream: bool
) -> None:
    url = migrated_sqlite(tmp_path / "atrium.db")
    (key,) = asyncio.run(create_tenant(url, tmp_path / "seed.spool", "engine", QUOTAS, 1))
    tokenizer = Tokenizer.from_dir(tiny_llama_dir)
    runtime = ModelRuntime("tiny", FailingEngine(tokenizer, raises), tokenizer, max_model_len=256)
    config = settings(
        database_url=url, admin_token=ADMIN_TOKEN, usage_spool_path=str(tmp_path / "u.spool")
    )
    auth = {"Authorization": f"Bearer {key}"}
    body = {"model": "tiny", "prompt": "fail", "max_tokens": 50, "stream": stream}
    with TestClient(create_app(config, engine=runtime, include_admin=False)) as client:
        responses = [client.post("/v1/completions", json=body, headers=auth) for _ in range(2)]
        client.blocking_portal.call(client.app.state.tenancy._meter.flush)
    # The answer so far stands, marked as cut short by the engine; the second request shows
    # the first one's slot came back.
    for response in responses:
        assert response.status_code == 200
        if stream:
            assert '"code":"engine_error"' in response.text
            assert response.text.endswith("data: [DONE]\n\n")
        else:
            choice = response.json()["choices"][0]
            assert choice["finish_reason"] == "error" and choice["text"] == "aaaaa"
    rows = asyncio.run(usage_rows(url))
    assert sorted(rows) == sorted(r.headers["x-request-id"] for r in responses)
    prompt_tokens = {p for _, p, _ in rows.values()}
    assert {(s, c) for s, _, c in rows.values()} == {("error", 5)} and len(prompt_tokens) == 1
    books = asyncio.run(read_books(url))
    assert books.budget_used == 2 * (5 + prompt_tokens.pop())
    assert (books.budget_reserved, books.reservations, books.in_flight) == (0, 0, 0)
