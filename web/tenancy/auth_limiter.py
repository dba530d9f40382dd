"""Failed authentication per client address: past a limit a minute, that address gets 429.

Keys are guessed by trying them; each try with a well-formed key may cost a database query. The
address is the connection's peer (behind a reverse proxy, the proxy's: set the limit to 0 there).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

from litestar.connection import ASGIConnection

from web.ops.errors import ApiError, retry_headers

WINDOW_S = 60.0
MAX_ADDRESSES = 10_000
STATE_KEY = "auth_limiter"


class FailedAuthLimiter:
    """At most ``limit`` failures per address in any ``WINDOW_S``; 0 turns it off."""

    def __init__(
        self,
        limit: int,
        *,
        max_addresses: int = MAX_ADDRESSES,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limit = limit
        self._max_addresses = max_addresses
        self._monotonic = monotonic
        self._failures: dict[str, deque[float]] = {}  # least recently failed first

    def retry_after_s(self, address: str) -> float | None:
        """Seconds until ``address`` may try again, or None when it may now."""
        failures = self._failures.get(address)
        if self.limit <= 0 or failures is None:
            return None
        now = self._monotonic()
        while failures and failures[0] <= now - WINDOW_S:
            failures.popleft()
        if not failures:
            del self._failures[address]
            return None
        if len(failures) < self.limit:
            return None
        return failures[0] + WINDOW_S - now

    def record_failure(self, address: str) -> None:
        if self.limit <= 0:
            return
        failures = self._failures.pop(address, None) or deque(maxlen=self.limit)
        while len(self._failures) >= self._max_addresses:
            del self._failures[next(iter(self._failures))]
        failures.append(self._monotonic())
        self._failures[address] = failures

    def check(self, address: str) -> None:
        """Raise a 429 with ``Retry-After`` while ``address`` is over its limit."""
        wait_s = self.retry_after_s(address)
        if wait_s is not None:
            raise ApiError(
                429,
                "Too many failed authentication attempts from your address; retry later.",
                code="too_many_failed_attempts",
                headers=retry_headers(wait_s),
            )


def client_address(connection: ASGIConnection[Any, Any, Any, Any]) -> str:
    client = connection.client
    return client.host if client is not None else "unknown"


def limiter_of(connection: ASGIConnection[Any, Any, Any, Any]) -> FailedAuthLimiter | None:
    """The app's limiter (absent in apps built without one, such as some tests' admin apps)."""
    limiter = connection.app.state.get(STATE_KEY)
    return limiter if isinstance(limiter, FailedAuthLimiter) else None
