"""Where each live request's outputs go: one sink per request id, shared across threads."""

from __future__ import annotations

import threading
from collections.abc import Callable

from engine.errors import InvalidRequestError
from engine.outputs import RequestOutput

Sink = Callable[[RequestOutput | BaseException], None]


class Sinks:
    """Registered by the event loop's side when a request is submitted, fed by whoever reports
    the loop's results; a request's sink goes with its finished output or its error."""

    def __init__(self) -> None:
        self._sinks: dict[str, Sink] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._sinks)

    def add(self, request_id: str, sink: Sink) -> None:
        """Raises InvalidRequestError while a request of that id is live."""
        with self._lock:
            if request_id in self._sinks:
                raise InvalidRequestError(f"request id {request_id!r} is already running")
            self._sinks[request_id] = sink

    def deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            with self._lock:
                sinks = self._sinks
                sink = sinks.pop(output.request_id, None) if output.finished else None
                sink = sink or sinks.get(output.request_id)
            if sink is not None:
                sink(output)

    def fail(self, request_id: str, exc: BaseException) -> None:
        """The request ends with ``exc`` (raised where its outputs are read)."""
        with self._lock:
            sink = self._sinks.pop(request_id, None)
        if sink is not None:
            sink(exc)

    def end_all(self, reason: str) -> None:
        """Every live request ends with an error output (the loop is gone)."""
        with self._lock:
            sinks, self._sinks = self._sinks, {}
        for request_id, sink in sinks.items():
            sink(RequestOutput(request_id, finished=True, finish_reason="error", error=reason))
