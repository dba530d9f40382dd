"""A burst's requests tell the engine how many others are right behind them (num_following)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import httpx
from litestar import Litestar
from litestar.testing import AsyncTestClient

from tests.integration.gateway_fakes import KEY_A, KEY_B, MODEL, make_runtime, make_tenancy
from tests.integration.gateway_fakes import settings as gateway_settings
from web.app import create_app


@contextlib.asynccontextmanager
async def completions(
    app: Litestar, max_tokens: int
) -> AsyncIterator[Callable[[int, str], Awaitable[int]]]:
    """``one(i, key)`` sends completion ``i`` with ``key`` and returns its status. The test client
    runs the app's lifespan; requests go through httpx's ASGI transport, which runs them
    concurrently (the test client takes them one at a time)."""
    transport = httpx.ASGITransport(app=app)
    async with (
        AsyncTestClient(app),
        httpx.AsyncClient(transport=transport, base_url="http://testserver") as client,
    ):

        async def one(i: int, key: str) -> int:
            body = {"model": MODEL, "prompt": f"hello {i}", "max_tokens": max_tokens}
            headers = {"Authorization": f"Bearer {key}"}
            response = await client.post("/v1/completions", json=body, headers=headers)
            return response.status_code

        yield one


def test_a_burst_counts_the_requests_still_arriving_and_refusals_leave_no_count(
    tiny_llama_dir: Path,
) -> None:
    runtime, engine = make_runtime(tiny_llama_dir)
    app = create_app(gateway_settings(), engine=runtime, store=make_tenancy(), include_admin=False)

    async def burst() -> tuple[list[int], int]:
        async with completions(app, max_tokens=2) as one:
            lone = await one(0, KEY_A)
            assert lone == 200 and engine.requests[-1].num_following == 0
            # Tenant B may run nothing: its requests are refused on admission.
            codes = await asyncio.gather(*(one(i, KEY_A if i % 3 else KEY_B) for i in range(1, 13)))
            service = app.state.generation
            return list(codes), service.num_arriving

    codes, left = asyncio.run(burst())
    assert codes.count(200) == 8 and codes.count(429) == 4
    assert left == 0  # admitted, refused: every arrival was counted out
    following = [r.num_following for r in engine.requests[1:]]
    assert len(following) == 8
    assert max(following) >= 1  # some were handed over while others were still arriving
    assert all(0 <= n <= 11 for n in following)


def test_each_request_tells_the_engine_its_tenants_count_at_the_gateway(
    tiny_llama_dir: Path,
) -> None:
    runtime, engine = make_runtime(tiny_llama_dir, delay_s=0.02)
    app = create_app(gateway_settings(), engine=runtime, store=make_tenancy(), include_admin=False)

    async def burst() -> tuple[list[int], dict[str, int]]:
        async with completions(app, max_tokens=3) as one:
            codes = await asyncio.gather(*(one(i, KEY_A if i < 6 else KEY_B) for i in range(9)))
            return list(codes), dict(app.state.generation.tenant_requests)

    codes, left = asyncio.run(burst())
    assert codes.count(200) == 6 and codes.count(429) == 3
    counts = [r.tenant_requests for r in engine.requests]
    assert len(counts) == 6 and all(1 <= n <= 6 for n in counts)
    assert max(counts) >= 4  # the burst was counted while it crossed the gateway
    assert left == {}  # finished and refused requests were all counted out
