"""A client leaving mid-stream aborts the engine request and still records its usage once;
a draining gateway refuses new work with 503 and Retry-After."""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from litestar import Litestar
from litestar.testing import TestClient

from engine.sampling_params import SamplingParams
from tests.integration.gateway_fakes import KEY_A, MODEL, make_runtime, make_tenancy, settings
from web.app import create_app
from web.openai.generation import GenerationService
from web.tenancy.principal import InMemoryTenancy, InMemoryTenant, Ticket


async def serve_then_leave(
    app: Litestar,
    path: str,
    body: dict[str, Any],
    leave: Callable[[], Awaitable[object]],
    on_body: Callable[[bytes], None] = lambda chunk: None,
) -> float:
    """Send one request to ``path`` over raw ASGI; the client disconnects once ``leave()``
    returns, and each body chunk it receives goes to ``on_body``. Returns how long the handler
    took, after waiting for the request's books to close."""
    sent_request = False

    async def receive() -> dict[str, Any]:
        nonlocal sent_request
        if not sent_request:
            sent_request = True
            return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}
        await leave()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body" and message.get("body"):
            on_body(message["body"])

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"authorization", f"Bearer {KEY_A}".encode()),
            (b"content-type", b"application/json"),
        ],
        "client": ("127.0.0.1", 1234),
        "server": ("127.0.0.1", 8000),
        "state": {},
    }
    async with app.lifespan():
        started = asyncio.get_running_loop().time()
        await app(scope, receive, send)  # type: ignore[arg-type]
        took = asyncio.get_running_loop().time() - started
        service: GenerationService = app.state.generation
        for _ in range(100):
            if not service.active and not service._tasks:
                break
            await asyncio.sleep(0.02)
    return took


async def stream_then_leave(app: Litestar, body: dict[str, Any], keep_chunks: int) -> list[bytes]:
    """Stream a chat answer and disconnect after ``keep_chunks`` body chunks."""
    received: list[bytes] = []
    enough = asyncio.Event()

    def on_body(chunk: bytes) -> None:
        received.append(chunk)
        if len(received) >= keep_chunks:
            enough.set()

    await serve_then_leave(app, "/v1/chat/completions", body, enough.wait, on_body)
    return received


def test_disconnect_aborts_and_records_partial_usage(tiny_llama_dir: Path) -> None:
    runtime, engine = make_runtime(tiny_llama_dir, delay_s=0.02)
    tenancy = make_tenancy()
    app = create_app(settings(), engine=runtime, store=tenancy, include_admin=False)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 200,
            "stream": True}  # fmt: skip
    received = asyncio.run(stream_then_leave(app, body, keep_chunks=4))
    assert b"[DONE]" not in b"".join(received)
    assert len(engine.aborted) == 1
    assert len(tenancy.usage) == 1
    usage = tenancy.usage[0]
    assert usage.request_id == engine.aborted[0]
    assert usage.status == "disconnect"
    assert 1 <= usage.completion_tokens < 200
    assert tenancy.running["tenant-a"] == 0  # the reservation was settled


def test_draining_gateway_refuses_new_requests(tiny_llama_dir: Path) -> None:
    runtime, engine = make_runtime(tiny_llama_dir)
    app = create_app(settings(), engine=runtime, store=make_tenancy(), include_admin=False)
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 2}
    with TestClient(app) as client:
        service: GenerationService = app.state.generation
        asyncio.run(service.drain(0.0))
        response = client.post(
            "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY_A}"}
        )
        assert response.status_code == 503
        assert response.headers["retry-after"] == "1"
        assert response.json()["error"]["code"] == "draining"
        assert client.get("/readyz").status_code == 503
    assert engine.requests == []


def test_disconnect_with_n_choices_aborts_each_and_records_once(tiny_llama_dir: Path) -> None:
    runtime, engine = make_runtime(tiny_llama_dir, delay_s=0.02)
    tenancy = make_tenancy()
    app = create_app(settings(), engine=runtime, store=tenancy, include_admin=False)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 200,
            "stream": True, "n": 3}  # fmt: skip
    received = asyncio.run(stream_then_leave(app, body, keep_chunks=6))
    assert b"[DONE]" not in b"".join(received)
    [usage] = tenancy.usage
    assert sorted(engine.aborted) == [f"{usage.request_id}-{i}" for i in range(3)]
    assert usage.status == "disconnect"
    assert 3 <= usage.completion_tokens < 600


class SlowCommitTenancy(InMemoryTenancy):
    """Holds the reservation, then takes a while to answer (a commit on a slow database)."""

    async def admit(self, *args: Any, **kwargs: Any) -> Ticket:
        ticket = await super().admit(*args, **kwargs)
        await asyncio.sleep(0.2)
        return ticket


def test_a_request_cancelled_during_admission_hands_its_reservation_back(
    tiny_llama_dir: Path,
) -> None:
    runtime, engine = make_runtime(tiny_llama_dir, delay_s=0.0)
    tenancy = SlowCommitTenancy()
    tenancy.add_key(KEY_A, InMemoryTenant("tenant-a"))
    app = create_app(settings(), engine=runtime, store=tenancy, include_admin=False)

    async def cancel_mid_admission() -> None:
        async with app.lifespan():
            service: GenerationService = app.state.generation
            principal = await tenancy.authenticate(KEY_A)
            admit = asyncio.ensure_future(
                service.admit(
                    principal, "chat", "req-gone", [1, 2, 3], SamplingParams(max_tokens=4)
                )
            )
            await asyncio.sleep(0.05)
            assert tenancy.running == {"tenant-a": 1}  # reserved, not yet answered
            admit.cancel()
            with pytest.raises(asyncio.CancelledError):
                await admit
            for _ in range(100):
                if not service._tasks:
                    break
                await asyncio.sleep(0.02)

    asyncio.run(cancel_mid_admission())
    assert tenancy.running == {"tenant-a": 0}
    assert [
        (u.request_id, u.status, u.prompt_tokens, u.completion_tokens) for u in tenancy.usage
    ] == [("req-gone", "disconnect", 0, 0)]
    assert engine.requests == []  # nothing reached the engine


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_gone_before_the_first_token_is_aborted_at_once(
    tiny_llama_dir: Path, stream: bool
) -> None:
    # Nothing is sent to a client until its first token (a whole answer unstreamed): the
    # engine would otherwise compute the answer for nobody, charged to the tenant's share.
    runtime, engine = make_runtime(tiny_llama_dir, delay_s=0.5)
    tenancy = make_tenancy()
    app = create_app(settings(), engine=runtime, store=tenancy, include_admin=False)
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 20, "stream": stream}
    took = asyncio.run(
        serve_then_leave(app, "/v1/completions", body, functools.partial(asyncio.sleep, 0.1))
    )
    assert took < 0.45  # not the 0.5 s of the first token, nor the 10 s of the whole answer
    [usage] = tenancy.usage
    assert engine.aborted == [usage.request_id]
    assert (usage.status, usage.completion_tokens) == ("disconnect", 0)
    assert tenancy.running["tenant-a"] == 0  # the reservation was settled
