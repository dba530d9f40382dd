"""The HTTP/1.1 connection `atrium serve` speaks: uvicorn's, with a header deadline and a cap.

uvicorn cancels its keep-alive timer on the first byte of a request and has no deadline for the
rest of the headers, so a client trickling one header line every few seconds holds a connection
(and a file descriptor) forever. Here every request's headers must be complete within
``header_timeout_s`` of the connection opening or of the previous response ending, its body
within ``body_timeout_s`` of its headers, and past ``max_connections`` open connections a new
one gets a 503 in the documented error shape.
"""

from __future__ import annotations

import asyncio
from typing import Any, ClassVar

import msgspec
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from web.ops.errors import ErrorBody, ErrorDetail


def overloaded_response(retry_after_s: int) -> bytes:
    """The whole HTTP response a connection over the limit gets before it is closed."""
    body = msgspec.json.encode(
        ErrorBody(
            ErrorDetail(
                message="Too many open connections; retry shortly.",
                type="service_unavailable",
                param=None,
                code="too_many_connections",
            )
        )
    )
    head = (
        "HTTP/1.1 503 Service Unavailable\r\n"
        "content-type: application/json\r\n"
        f"content-length: {len(body)}\r\n"
        f"retry-after: {retry_after_s}\r\n"
        "connection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


class GuardedHttpProtocol(HttpToolsProtocol):  # type: ignore[misc]
    """uvicorn's httptools protocol with a header-read deadline and a connection cap."""

    header_timeout_s: ClassVar[float] = 10.0
    body_timeout_s: ClassVar[float] = 60.0
    max_connections: ClassVar[int | None] = None
    retry_after_s: ClassVar[int] = 1

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._read_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        limit = self.max_connections
        super().connection_made(transport)
        if limit is not None and len(self.connections) > limit:
            transport.write(overloaded_response(self.retry_after_s))
            transport.close()
            return
        self._arm_read_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()
        if not self.pipeline:  # a queued request's body waits for the one before it
            self._arm(self.body_timeout_s)

    def on_message_complete(self) -> None:
        self._disarm()
        super().on_message_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # The next request's headers, if the connection stays open, get a deadline of their own.
        if not self.transport.is_closing() and not self.pipeline:
            self._arm_read_deadline()

    def _arm_read_deadline(self) -> None:
        self._arm(self.header_timeout_s)

    def _arm(self, timeout_s: float) -> None:
        self._disarm()
        self._read_deadline = self.loop.call_later(timeout_s, self._read_late)

    def _disarm(self) -> None:
        if self._read_deadline is not None:
            self._read_deadline.cancel()
            self._read_deadline = None

    def _read_late(self) -> None:
        self._read_deadline = None
        if not self.transport.is_closing():
            self.transport.close()


def guarded_protocol(
    header_timeout_s: float,
    max_connections: int | None,
    retry_after_s: int = 1,
    body_timeout_s: float = 60.0,
) -> type[GuardedHttpProtocol]:
    """A protocol class with these limits, for ``uvicorn.Config(http=...)``."""
    return type(
        "AtriumHttpProtocol",
        (GuardedHttpProtocol,),
        {
            "header_timeout_s": header_timeout_s,
            "body_timeout_s": body_timeout_s,
            "max_connections": max_connections,
            "retry_after_s": retry_after_s,
        },
    )
