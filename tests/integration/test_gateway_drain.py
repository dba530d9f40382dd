"""Draining on shutdown: running requests finish within the grace period, the rest are aborted
and metered, new work gets 503, and every usage event is stored exactly once before exit."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from litestar.testing import TestClient

from engine.outputs import GenerateRequest, RequestOutput
from engine.tokenizer import Tokenizer
from tenants.schemas import Quotas
from tests.integration.gateway_fakes import settings
from tests.integration.pg_gateway import ADMIN_TOKEN, create_tenant, read_books
from tests.integration.test_admin_app import migrated_sqlite
from web.app import create_app
from web.openai.generation import ModelRuntime

MODEL = "tiny-llama"
TOKEN_S = 0.01  # one token every 10 ms
GRACE_S = 1.0


@dataclass
class PacedEngine:
    """One token every ``TOKEN_S``; an aborted request ends at its next token with ``abort``."""

    tokenizer: Tokenizer
    running: set[str] = field(default_factory=set)
    aborted: set[str] = field(default_factory=set)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        token = self.tokenizer.encode("a")[0]
        self.running.add(request.request_id)
        try:
            for n in range(1, request.params.max_tokens + 1):
                await asyncio.sleep(TOKEN_S)
                aborted = request.request_id in self.aborted
                done = aborted or n == request.params.max_tokens
                yield RequestOutput(
                    request_id=request.request_id,
                    token_ids=[token],
                    text="a",
                    finished=done,
                    finish_reason=("abort" if aborted else "length") if done else None,
                    num_prompt_tokens=len(request.prompt_token_ids),
                    num_output_tokens=n,
                )
                if done:
                    return
        finally:
            self.running.discard(request.request_id)

    def abort(self, request_id: str) -> None:
        self.aborted.add(request_id)


def _stream(client: Any, key: str, max_tokens: int, out: dict[str, Any], n: int = 1) -> None:
    body = {
        "model": MODEL,
        "prompt": "drain me",
        "max_tokens": max_tokens,
        "n": n,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    response = client.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})
    frames = [f.removeprefix("data: ") for f in response.text.split("\n\n") if f.strip()]
    out["status"] = response.status_code
    out["request_id"] = response.headers.get("x-request-id")
    out["done"] = frames[-1] == "[DONE]"
    chunks = [json.loads(f) for f in frames[:-1]]
    out["usage"] = chunks[-1]["usage"]
    out["finish"] = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1]
    out["finished_at"] = time.monotonic()


@pytest.mark.parametrize("n", [1, 3])  # the long request's choices: each one is aborted
def test_sigterm_drain_finishes_short_requests_aborts_long_ones_and_meters_all(
    tiny_llama_dir: Path, tmp_path: Path, n: int
) -> None:
    url = migrated_sqlite(tmp_path / "drain.db")
    (key,) = asyncio.run(
        create_tenant(url, tmp_path / "seed.spool", "drain", Quotas(monthly_token_budget=10**6), 1)
    )
    tokenizer = Tokenizer.from_dir(tiny_llama_dir)
    engine = PacedEngine(tokenizer)
    runtime = ModelRuntime(MODEL, engine, tokenizer, max_model_len=4096)
    config = settings(
        database_url=url,
        admin_token=ADMIN_TOKEN,
        usage_spool_path=str(tmp_path / "usage.spool"),
        drain_grace_s=GRACE_S,
    )
    app = create_app(config, engine=runtime, include_admin=False)
    results: dict[str, dict[str, Any]] = {"short1": {}, "short2": {}, "long": {}}
    lengths = {"short1": 20, "short2": 40, "long": 3000}  # 0.2 s, 0.4 s, 30 s of tokens
    with TestClient(app) as client:
        threads = [
            threading.Thread(
                target=_stream,
                args=(client, key, lengths[name], results[name], n if name == "long" else 1),
            )
            for name in results
        ]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 20
        while len(engine.running) < 2 + n:
            assert time.monotonic() < deadline, "the requests never reached the engine"
            time.sleep(0.01)
        service = app.state.generation
        started = time.monotonic()
        drained = threading.Thread(
            target=client.blocking_portal.call, args=(service.drain, GRACE_S)
        )
        drained.start()
        while not service.draining:
            time.sleep(0.005)
        refused = client.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": "late", "max_tokens": 2},
            headers={"Authorization": f"Bearer {key}"},
        )
        drained.join(10)
        drain_s = time.monotonic() - started
        for thread in threads:
            thread.join(10)
    # Leaving the client ran the lifespan's shutdown: drain (nothing left), then the meter flush.

    assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
    assert refused.headers["retry-after"]
    assert GRACE_S <= drain_s < GRACE_S + 2.0
    for name in ("short1", "short2"):
        short = results[name]
        assert short["status"] == 200 and short["done"] and short["finish"] == "length"
        assert short["usage"]["completion_tokens"] == lengths[name]
        assert short["finished_at"] - started < GRACE_S
    long = results["long"]
    assert long["status"] == 200 and long["done"]
    assert n <= long["usage"]["completion_tokens"] < n * lengths["long"]  # cut short, billed
    books = asyncio.run(read_books(url))
    served = {r["request_id"]: r["usage"]["total_tokens"] for r in results.values()}
    assert sorted(books.request_ids) == sorted(served)  # each once, the aborted one too
    assert books.budget_used == sum(served.values())
    assert (books.budget_reserved, books.reservations, books.in_flight) == (0, 0, 0)
    assert not (tmp_path / "usage.spool").exists() or (tmp_path / "usage.spool").stat().st_size == 0
