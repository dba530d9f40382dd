"""Failed authentications shared by every gateway: one row per failure, counted per client
address over a sliding window, so N gateways hold an address to one limit, not N of them."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from sqlalchemy import delete, select

from tenants.database import Database
from tenants.models import AuthFailure

MAX_ADDRESS_CHARS = 128  # the column's width; longer (forwarded) names are cut to it


class AuthFailureStore:
    """Records failures and says how long an address must wait (wall clock, epoch seconds:
    the gateways' clocks must agree to well under the window)."""

    def __init__(self, db: Database, clock: Callable[[], float] = time.time) -> None:
        self._db = db
        self._clock = clock
        self._pruned_at = -math.inf  # when this store last dropped every address's old rows

    async def record(self, address: str, limit: int, window_s: float) -> float | None:
        """Store one failure of ``address``; then, when it has ``limit`` or more failures in the
        last ``window_s`` (on any gateway), the seconds until the oldest of its last ``limit``
        ages out, else None."""
        if limit <= 0:
            return None
        address = address[:MAX_ADDRESS_CHARS]
        now = self._clock()
        since = now - window_s
        if now - self._pruned_at >= window_s:  # addresses that failed once and went away
            self._pruned_at = now
            async with self._db.transaction() as session:
                await session.execute(delete(AuthFailure).where(AuthFailure.failed_at <= since))
        async with self._db.transaction() as session:
            # Only this address's rows here, so that concurrent failures lock few rows.
            await session.execute(
                delete(AuthFailure).where(
                    AuthFailure.address == address, AuthFailure.failed_at <= since
                )
            )
            session.add(AuthFailure(address=address, failed_at=now))
            await session.flush()
            recent = list(
                await session.scalars(
                    select(AuthFailure.failed_at)
                    .where(AuthFailure.address == address, AuthFailure.failed_at > since)
                    .order_by(AuthFailure.failed_at.desc())
                    .limit(limit)
                )
            )
        if len(recent) < limit:
            return None
        return max(0.0, min(recent) + window_s - now)
