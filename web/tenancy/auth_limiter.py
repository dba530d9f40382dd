"""Failed authentication per client address: past a limit a minute, that address gets 429.

Keys are guessed by trying them; each try with a well-formed key may cost a database query. The
address is the connection's peer, or the one a proxy listed in ``forwarded_allow_ips`` forwards.
Failures are also counted in the tenant database, shared by every gateway; this process's own
count stands alone while the database is away.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import structlog
from litestar.connection import ASGIConnection

from web.ops.errors import ApiError, retry_headers

WINDOW_S = 60.0
MAX_ADDRESSES = 10_000
STATE_KEY = "auth_limiter"
SHARED_TIMEOUT_S = 1.0  # a failure's answer waits at most this long for the shared count

log = structlog.get_logger("atrium.web")


class SharedFailures(Protocol):
    """Failures counted by every gateway (``tenants.auth_failures.AuthFailureStore``)."""

    async def record(self, address: str, limit: int, window_s: float) -> float | None:
        """Store one failure; seconds ``address`` must wait now, or None."""
        ...


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
        self._held: dict[str, float] = {}  # address: until when (monotonic) the shared count says
        self.shared: SharedFailures | None = None  # set once the tenant database is open

    def retry_after_s(self, address: str) -> float | None:
        """Seconds until ``address`` may try again, or None when it may now."""
        if self.limit <= 0:
            return None
        now = self._monotonic()
        held = self._held.get(address)
        if held is not None and held > now:
            return held - now
        if held is not None:
            del self._held[address]
        failures = self._failures.get(address)
        if failures is None:
            return None
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

    async def fail(self, address: str) -> None:
        """Record a failure here and in the shared count; an address the shared count holds
        (its failures on all gateways together) is held here too. A database that fails or
        is slow leaves this process's own count to decide."""
        self.record_failure(address)
        if self.shared is None or self.limit <= 0:
            return
        try:
            async with asyncio.timeout(SHARED_TIMEOUT_S):
                wait_s = await self.shared.record(address, self.limit, WINDOW_S)
        except Exception as exc:  # the database is away: the count in memory still holds
            log.warning("auth_failures_unshared", error=type(exc).__name__)
            return
        if wait_s is not None and wait_s > 0:
            while len(self._held) >= self._max_addresses:
                del self._held[next(iter(self._held))]
            self._held[address] = self._monotonic() + wait_s

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
