"""`atrium serve`'s HTTP server: slow header senders are cut off, connections are capped."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import uvicorn

from web.cli.serve import server_config
from web.ops.server_protocol import guarded_protocol
from web.settings import Settings


async def _app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    while scope["method"] == "POST" and (await receive()).get("more_body"):
        pass  # read the whole body first
    await send(
        {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]}
    )
    await send({"type": "http.response.body", "body": b"ok"})


@asynccontextmanager
async def _serving(body_timeout_s: float | None = None, **limits: Any) -> AsyncIterator[int]:
    settings = Settings(host="127.0.0.1", port=0, **limits)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = server_config(_app, settings)
    if body_timeout_s is not None:
        config.http = guarded_protocol(settings.header_timeout_s, None, 1, body_timeout_s)
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        yield port
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)
        sock.close()


async def _close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()


async def _closed(reader: asyncio.StreamReader) -> bytes:
    return await reader.read()  # until the server closes the connection


def test_a_client_trickling_header_lines_is_cut_off_at_the_deadline() -> None:
    asyncio.run(_a_client_trickling_header_lines_is_cut_off_at_the_deadline())


async def _a_client_trickling_header_lines_is_cut_off_at_the_deadline() -> None:
    async with _serving(header_timeout_s=1.0) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        started = time.monotonic()
        writer.write(b"GET / HTTP/1.1\r\nhost: x\r\n")
        closed = asyncio.create_task(_closed(reader))
        sent = 0
        while not closed.done() and sent < 20:
            await asyncio.sleep(0.3)  # one header line every 0.3 s: each resets nothing
            if writer.is_closing():
                break
            writer.write(f"x-slow-{sent}: 1\r\n".encode())
            sent += 1
        await asyncio.wait_for(closed, 5)
        elapsed = time.monotonic() - started
        await _close(writer)
    assert closed.result() == b""  # closed without a response
    assert 0.9 <= elapsed < 2.5, elapsed
    assert sent < 8


def test_a_prompt_client_is_served_and_its_next_request_gets_a_fresh_deadline() -> None:
    asyncio.run(_a_prompt_client_is_served_and_its_next_request_gets_a_fresh_deadline())


async def _a_prompt_client_is_served_and_its_next_request_gets_a_fresh_deadline() -> None:
    async with _serving(header_timeout_s=1.0) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        for _ in range(3):  # 3 requests over ~1.8 s on one connection, each quick
            writer.write(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            response = await asyncio.wait_for(reader.readuntil(b"ok"), 5)
            assert response.startswith(b"HTTP/1.1 200")
            await asyncio.sleep(0.6)
        await _close(writer)


def test_an_idle_connection_never_sending_a_byte_is_closed() -> None:
    asyncio.run(_an_idle_connection_never_sending_a_byte_is_closed())


async def _an_idle_connection_never_sending_a_byte_is_closed() -> None:
    async with _serving(header_timeout_s=0.5, keep_alive_timeout_s=30) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        assert await asyncio.wait_for(reader.read(), 5) == b""
        await _close(writer)


def test_connections_past_the_cap_get_503_in_the_error_shape() -> None:
    asyncio.run(_connections_past_the_cap_get_503_in_the_error_shape())


async def _connections_past_the_cap_get_503_in_the_error_shape() -> None:
    async with _serving(max_connections=2, header_timeout_s=5.0) as port:
        held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
        await asyncio.sleep(0.1)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        response = await asyncio.wait_for(reader.read(), 5)
        await _close(writer)
        head, _, body = response.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503")
        assert b"retry-after: 1" in head
        assert json.loads(body)["error"]["code"] == "too_many_connections"
        # Once one held connection goes, a new one is served.
        await _close(held[0][1])
        await asyncio.sleep(0.2)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        assert (await asyncio.wait_for(reader.readuntil(b"ok"), 5)).startswith(b"HTTP/1.1 200")
        await _close(writer)
        await _close(held[1][1])


def test_a_client_trickling_its_body_is_cut_off_at_the_body_deadline() -> None:
    asyncio.run(_a_client_trickling_its_body_is_cut_off_at_the_body_deadline())


async def _a_client_trickling_its_body_is_cut_off_at_the_body_deadline() -> None:
    async with _serving(body_timeout_s=1.0, header_timeout_s=5.0) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        # A whole body in time is served.
        writer.write(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 4\r\n\r\nabcd")
        assert (await asyncio.wait_for(reader.readuntil(b"ok"), 5)).startswith(b"HTTP/1.1 200")
        started = time.monotonic()
        writer.write(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n")
        closed = asyncio.create_task(_closed(reader))
        sent = 0
        while not closed.done() and sent < 20:
            await asyncio.sleep(0.3)  # one byte every 0.3 s: 30 s for the whole body
            if writer.is_closing():
                break
            writer.write(b"x")
            sent += 1
        await asyncio.wait_for(closed, 5)
        elapsed = time.monotonic() - started
        await _close(writer)
    assert closed.result() == b""
    assert 0.9 <= elapsed < 2.5, elapsed
