"""A TCP proxy on 127.0.0.1, on a thread of its own, that a test can cut and restore.

``cut`` stops listening (new connections are refused) and aborts every open connection, the way a
database host that goes away looks to its clients; ``restore`` listens on the same port again.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")
CHUNK = 64 * 1024


class TcpProxy:
    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.port = 0
        self.connections = 0  # accepted so far
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.Server | None = None
        self._transports: set[asyncio.BaseTransport] = set()

    def __enter__(self) -> TcpProxy:
        self._thread.start()
        self._call(self._listen())
        return self

    def __exit__(self, *_: object) -> None:
        self.cut()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._loop.close()

    def cut(self) -> None:
        self._call(self._cut())

    def restore(self) -> None:
        self._call(self._listen())

    @property
    def listening(self) -> bool:
        return self._server is not None

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=10)

    async def _listen(self) -> None:
        if self._server is None:
            self._server = await asyncio.start_server(
                self._handle, "127.0.0.1", self.port, reuse_address=True
            )
            self.port = self._server.sockets[0].getsockname()[1]

    async def _cut(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()
        for transport in list(self._transports):
            transport.abort()
        self._transports.clear()
        if server is not None:
            await server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            return
        pair = (writer.transport, upstream_writer.transport)
        self._transports.update(pair)
        try:
            await asyncio.gather(_pipe(reader, upstream_writer), _pipe(upstream_reader, writer))
        finally:
            for transport in pair:
                self._transports.discard(transport)
                transport.abort()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(ConnectionError, OSError):
        while data := await reader.read(CHUNK):
            writer.write(data)
            await writer.drain()
    with contextlib.suppress(ConnectionError, OSError, RuntimeError):
        writer.write_eof()
