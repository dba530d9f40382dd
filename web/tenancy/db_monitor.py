"""Whether the tenant database answers: outages are noticed by failing calls or failing probes.

While it is down callers skip it (degraded mode). A background task probes it on a connection of
its own: while up, every few seconds (a few failures in a row start an outage, one slow probe does
not); while down, with exponential back-off, running the recovery hooks once it answers.
Readiness reads the last known state: no client request makes the gateway probe.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable

import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge

from tenants.database import is_unavailable
from web.ops.metrics import tenant_labels

log = structlog.get_logger("atrium.web")
Hook = Callable[[], Awaitable[None]]
Probe = Callable[[float], Awaitable[bool]]


class DegradedMetrics:
    """What degraded mode did, registered on the gateway's own registry."""

    def __init__(self, registry: CollectorRegistry, *, per_tenant: bool = False) -> None:
        r = registry
        self.per_tenant = per_tenant
        self.database_up = Gauge(
            "atrium_database_up", "1 while the tenant database answers", registry=r
        )
        self.outages = Counter("atrium_database_outages", "Tenant database outages", registry=r)
        self.degraded_admissions = Counter(
            "atrium_admissions_degraded", "Requests admitted without the database",
            tenant_labels(per_tenant), registry=r,
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
        failures_to_degrade: int = 3,
        backoff_initial_s: float = 0.25,
        backoff_max_s: float = 5.0,
        sweep_interval_s: float = 2.0,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._probe = probe
        self._metrics = metrics
        self._probe_timeout_s = probe_timeout_s
        self._failures_to_degrade = max(1, failures_to_degrade)
        self.failed_probes = 0  # consecutive failed probes while up
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
        """Readiness: the state the last calls and probes left, without probing now (so that
        anonymous `/readyz` requests can neither load the database nor degrade the gateway)."""
        return not self.down

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
                # asyncio.timeout, not wait_for: Python 3.11's wait_for can swallow a
                # cancellation that lands as the wait ends, and stop() would then hang.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self._sweep_interval_s):
                        await self._wake.wait()
                self._wake.clear()
                if not self.down and await self._probe_while_up():
                    await self._run_sweep()
                continue
            await asyncio.sleep(backoff)
            if await self._probe(self._probe_timeout_s):
                await self._recover()
                backoff = self._backoff_initial_s
            else:
                backoff = min(backoff * 2, self._backoff_max_s)

    async def _probe_while_up(self) -> bool:
        """Probe once; only ``failures_to_degrade`` failures in a row start an outage."""
        if await self._probe(self._probe_timeout_s):
            self.failed_probes = 0
            return True
        self.failed_probes += 1
        log.info("database_probe_failed", consecutive=self.failed_probes)
        if self.failed_probes >= self._failures_to_degrade:
            self._mark_down("probe_failed")
        return False

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
        self.failed_probes = 0
        self._metrics.database_up.set(1)
        outage_s = 0.0 if started is None else self._monotonic() - started
        log.info("database_recovered", outage=self.outages, outage_s=round(outage_s, 3))
        # Every hook runs even when one fails: a failed settle retry must not skip the meter's
        # flush. A hook failing because the database went away again starts a new outage, and
        # the next recovery runs them all again (each hook is idempotent).
        for hook in self.recovery_hooks:
            try:
                await hook()
            except Exception as error:
                if not self.report(error):
                    log.exception("database_recovery_hook_failed")
