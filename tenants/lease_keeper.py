"""A gateway's lease kept alive: renewed every third of its period, and dead gateways reclaimed.

One task per gateway process. A renewal or reclaim that fails (the database is away) is
retried at the next tick; a lease found gone is replaced by a new one for later admissions.
"""

from __future__ import annotations

import asyncio
import contextlib

import structlog

from tenants.leases import LeaseService

log = structlog.get_logger("tenants.leases")


class LeaseKeeper:
    def __init__(self, leases: LeaseService, lease_s: float) -> None:
        if lease_s <= 0:
            raise ValueError("lease_s must be positive")
        self._leases = leases
        self.lease_s = lease_s
        self.lease_id: str | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def interval_s(self) -> float:
        """Between renewals: a lease survives two missed ones."""
        return self.lease_s / 3.0

    async def start(self) -> None:
        """Take a lease, settle what expired gateways left behind, then keep renewing."""
        self.lease_id = await self._leases.acquire(self.lease_s)
        log.info("gateway_lease_acquired", lease_id=self.lease_id, lease_s=self.lease_s)
        await self._reclaim()
        self._task = asyncio.create_task(self._run(), name="gateway-lease")

    async def tick(self) -> None:
        """Renew the lease (or take a new one if it was lost), then reclaim expired ones."""
        if self.lease_id is None or not await self._leases.renew(self.lease_id, self.lease_s):
            lost, self.lease_id = self.lease_id, await self._leases.acquire(self.lease_s)
            log.warning("gateway_lease_replaced", lost=lost, lease_id=self.lease_id)
        await self._reclaim()

    async def stop(self) -> None:
        """Stop renewing and end the lease, so what it still holds is reclaimed at once."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        lease_id, self.lease_id = self.lease_id, None
        if lease_id is not None:
            try:
                await self._leases.release(lease_id)
            except Exception as error:  # it expires by itself
                log.warning("gateway_lease_release_failed", error=repr(error))

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.tick()
            except Exception as error:
                log.warning("gateway_lease_renewal_failed", error=repr(error))

    async def _reclaim(self) -> None:
        try:
            await self._leases.reclaim()
        except Exception as error:
            log.warning("gateway_lease_reclaim_failed", error=repr(error))
