"""Whether the tenant database answers: outages are noticed by failing calls, recovery by a probe.

While it is down callers skip it (degraded mode); a background task probes it with a short timeout
and exponential back-off, runs the recovery hooks once it answers, and sweeps while it is up.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable

import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge

from tenants.database import is_unavailable

log = structlog.get_logger("atrium.web")
Hook = Callable[[], Awaitable[None]]
Probe = Callable[[float], Awaitable[bool]]


class DegradedMetrics:
    """What degraded mode did, registered on the gateway's own registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.database_up = Gauge(
            "atrium_database_up", "1 while the tenant database answers", registry=r
        )
        self.outages = Counter("atrium_database_outages", "Tenant database outages", registry=r)
        self.degraded_admissions = Counter(
            "atrium_admissions_degraded", "Requests admitted without the database", ["tenant"],
            registry=r,
        )  # fmt: skip
        self.unverified_keys = Counter(
            "atrium_auth_unverified", "Keys refused with 503: never verified before the outage",
            registry=r,
        )  # fmt: skip
        self.pending_settles = Gauge(
            "atrium_settles_pending", "Reservations waiting for the database to settle",
            registry=r,
        )  # fmt: skip
        self.database_up.set(1)


class DatabaseMonitor:
    """Up or down, and the task that brings it back up. Runs on the event loop's thread only."""

    def __init__(
        self,
        probe: Probe,
        metrics: DegradedMetrics,
        *,
        probe_timeout_s: float = 2.0,
        backoff_initial_s: float = 0.25,
        backoff_max_s: float = 5.0,
        sweep_interval_s: float = 2.0,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._probe = probe
        self._metrics = metrics
        self._probe_timeout_s = probe_timeout_s
        self._backoff_initial_s = backoff_initial_s
        self._backoff_max_s = backoff_max_s
        self._sweep_interval_s = sweep_interval_s
        self._monotonic = monotonic
        self._down_since: float | None = None
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.recovery_hooks: list[Hook] = []
        self.sweep: Hook | None = None
        self.outages = 0  # number of the current (or last) outage

    @property
    def down(self) -> bool:
        return self._down_since is not None

    def report(self, error: BaseException) -> bool:
        """Note a failed call. True when ``error`` means the database is unreachable (the caller
        then serves degraded); False for any other error (the caller re-raises it)."""
        if not is_unavailable(error):
            return False
        self._mark_down(type(error).__name__)
        return True

    async def check(self) -> bool:
        """Readiness: False while down; otherwise probe now (a failure starts an outage)."""
        if self.down:
            return False
        if await self._probe(self._probe_timeout_s):
            return True
        self._mark_down("probe_failed")
        return False

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="db-monitor")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def _mark_down(self, reason: str) -> None:
        if self._down_since is not None:
            return
        self._down_since = self._monotonic()
        self.outages += 1
        self._metrics.database_up.set(0)
        self._metrics.outages.inc()
        log.warning("database_unavailable", reason=reason, outage=self.outages)
        self._wake.set()

    async def _run(self) -> None:
        backoff = self._backoff_initial_s
        while True:
            if not self.down:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self._sweep_interval_s)
                self._wake.clear()
                if not self.down:
                    await self._run_sweep()
                continue
            await asyncio.sleep(backoff)
            if await self._probe(self._probe_timeout_s):
                await self._recover()
                backoff = self._backoff_initial_s
            else:
                backoff = min(backoff * 2, self._backoff_max_s)

    async def _run_sweep(self) -> None:
        if self.sweep is None:
            return
        try:
            await self.sweep()
        except Exception as error:
            if not self.report(error):
                log.exception("database_sweep_failed")

    async def _recover(self) -> None:
        started = self._down_since
        self._down_since = None
        self._metrics.database_up.set(1)
        outage_s = 0.0 if started is None else self._monotonic() - started
        log.info("database_recovered", outage=self.outages, outage_s=round(outage_s, 3))
        for hook in self.recovery_hooks:
            try:
                await hook()
            except Exception as error:
                if not self.report(error):
                    log.exception("database_recovery_hook_failed")
                return
