"""Gateway leases: slots and reservations have an owner that can die, and that others outlive.

Each gateway holds a lease row it renews while alive. Once a lease has expired, any gateway
settles the reservations it held: the slot and the unused tokens come back, and the request
gets its one usage event (``gateway_lost``: the prompt, and the output tokens the dead gateway
had checkpointed on the reservation) unless it already has one.
Times are the gateways' own UTC clocks, so their skew must stay well below the lease period.
"""

from __future__ import annotations

import secrets
from datetime import datetime, timedelta

import structlog
from sqlalchemy import ColumnElement, and_, delete, exists, or_, select, update

from tenants.database import Database
from tenants.models import GatewayLease, Reservation, UsageEventRow
from tenants.settlement import lost_event, release, take_reservation
from tenants.timeutil import Clock, utc_now
from tenants.usage_store import insert_events

log = structlog.get_logger("tenants.leases")
# Reservations made before leases existed have no owner: settled once surely abandoned.
UNOWNED_AFTER = timedelta(hours=1)
RECLAIM_BATCH = 200


class LeaseService:
    def __init__(self, db: Database, clock: Clock = utc_now) -> None:
        self._db = db
        self._clock = clock

    async def acquire(self, lease_s: float, lease_id: str | None = None) -> str:
        """Start (or restart, after it was removed) a lease; returns its id."""
        lease_id = lease_id or secrets.token_hex(8)
        now = self._clock()
        async with self._db.transaction() as session:
            session.add(
                GatewayLease(
                    id=lease_id, started_at=now, expires_at=now + timedelta(seconds=lease_s)
                )
            )
        return lease_id

    async def renew(self, lease_id: str, lease_s: float) -> bool:
        """Push the lease's expiry ``lease_s`` ahead; False when the row is gone (reclaimed
        after expiring), so the caller starts a new lease."""
        expires = self._clock() + timedelta(seconds=lease_s)
        async with self._db.transaction() as session:
            result = await session.execute(
                update(GatewayLease).where(GatewayLease.id == lease_id).values(expires_at=expires)
            )
        return bool(result.rowcount)  # type: ignore[attr-defined]

    async def release(self, lease_id: str) -> None:
        """End the lease now (a clean stop): whatever it still holds is reclaimable at once."""
        async with self._db.transaction() as session:
            await session.execute(
                update(GatewayLease)
                .where(GatewayLease.id == lease_id)
                .values(expires_at=self._clock())
            )

    async def reclaim(self) -> int:
        """Settle every reservation whose lease has expired (or that has none and is old);
        returns how many this call settled. Safe to run from several gateways at once."""
        now = self._clock()
        orphaned = self._orphaned(now)
        async with self._db.sessions() as session:
            request_ids = list(
                await session.scalars(
                    select(Reservation.request_id).where(orphaned).limit(RECLAIM_BATCH)
                )
            )
        settled = 0
        for request_id in request_ids:
            if await self._settle_lost(request_id, orphaned, now):
                settled += 1
        async with self._db.transaction() as session:
            # Expired leases that hold nothing any more are history.
            await session.execute(
                delete(GatewayLease).where(
                    GatewayLease.expires_at <= now,
                    ~exists().where(Reservation.lease_id == GatewayLease.id),
                )
            )
        if settled:
            log.warning("reservations_reclaimed", count=settled)
        return settled

    def _orphaned(self, now: datetime) -> ColumnElement[bool]:
        live = select(GatewayLease.id).where(GatewayLease.expires_at > now)
        return or_(
            and_(Reservation.lease_id.is_(None), Reservation.created_at < now - UNOWNED_AFTER),
            and_(Reservation.lease_id.is_not(None), Reservation.lease_id.not_in(live)),
        )

    async def _settle_lost(
        self, request_id: str, orphaned: ColumnElement[bool], now: datetime
    ) -> bool:
        async with self._db.transaction() as session:
            held = await take_reservation(session, request_id, orphaned)
            if held is None:  # settled meanwhile, by its own gateway or another reclaimer
                return False
            stored = await session.get(UsageEventRow, request_id)
            if stored is None:
                await insert_events(self._db, session, [lost_event(held, now)])
                completion = held.completion_tokens
                charged, cached = held.prompt_tokens + completion, 0
            else:  # the event was stored (spooled, replayed) but the settle never came
                charged = stored.prompt_tokens + stored.completion_tokens
                cached, completion = stored.cached_tokens, stored.completion_tokens
            await release(session, held, charged, cached, completion)
        log.info("request_settled_for_lost_gateway", request_id=request_id, charged=charged)
        return True
