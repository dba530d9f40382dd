"""The gateway's tenancy over the SQL services of `tenants/`, serving on when the database is away.

While the database is unreachable, keys verified lately still authenticate, admission runs on
in-process limits, usage goes to the meter's spool and settlements wait; all of it is reconciled
once the monitor sees the database answer again.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

import structlog
from litestar.datastructures import State
from prometheus_client import CollectorRegistry
from sqlalchemy import exc as sa_exc

from tenants.admission import AdmissionService
from tenants.auth_failures import AuthFailureStore
from tenants.batch_files import FileService
from tenants.batch_store import BatchStore
from tenants.database import Database, is_unavailable
from tenants.domain import TenantDomain
from tenants.errors import InvalidKeyError, TenantSuspendedError
from tenants.key_service import KeyService
from tenants.lease_keeper import LeaseKeeper
from tenants.meter import UsageMeter
from tenants.rate_limit import RateState
from tenants.records import UsageEvent
from tenants.schema_version import upgrade_unless_newer
from tenants.schemas import Admission, AuthContext, Usage
from tenants.timeutil import month_period
from web.ops.errors import unavailable
from web.ops.rate_headers import aged, ratelimit_headers
from web.settings import Settings
from web.tenancy.auth_fallback import KnownKeys
from web.tenancy.auth_limiter import STATE_KEY as AUTH_LIMITER
from web.tenancy.auth_limiter import FailedAuthLimiter
from web.tenancy.db_monitor import DatabaseMonitor, DegradedMetrics
from web.tenancy.degraded import LocalAdmission, LocalTicket
from web.tenancy.principal import Principal, Ticket, UsageRecord

log = structlog.get_logger("atrium.web")
RETRY_AFTER_S = 5.0  # what a key never verified before an outage is told


class SqlTenancy:
    """Keys, admission with reservations and the usage meter, with a degraded mode."""

    def __init__(
        self,
        keys: KeyService,
        admission: AdmissionService,
        meter: UsageMeter,
        db: Database,
        *,
        registry: CollectorRegistry | None = None,
        per_tenant_metrics: bool = False,
        known_keys: KnownKeys | None = None,
        sweep_interval_s: float = 2.0,
        lease: LeaseKeeper | None = None,
    ) -> None:
        self._keys = keys
        self._admission = admission
        self._meter = meter
        self._contexts: dict[str, AuthContext] = {}
        # Each key's last admission or refusal rate state and when (monotonic): what its other
        # errors report in ``x-ratelimit-*`` without asking the database.
        self._rates: dict[str, tuple[RateState, float]] = {}
        self.metrics = DegradedMetrics(
            registry or CollectorRegistry(), per_tenant=per_tenant_metrics
        )
        self.known = KnownKeys() if known_keys is None else known_keys  # empty is falsy
        self.local = LocalAdmission(self.metrics)
        self.monitor = DatabaseMonitor(db.probe, self.metrics, sweep_interval_s=sweep_interval_s)
        self.monitor.sweep = self._sweep_refusals
        self.monitor.recovery_hooks += [self._retry_settles, self._meter.flush]
        self._pending: dict[str, tuple[Admission, Usage]] = {}
        self.lease = lease  # owns this gateway's reservations (None: they have no owner)
        self._checkpoints: dict[str, int] = {}  # output tokens last recorded, by request id
        self._checkpointer: asyncio.Task[None] | None = None
        # Called with a tenant id once it is suspended or deleted (the engine drops its cache).
        self.on_tenant_gone: list[Callable[[str], None]] = []

    def start(self) -> None:
        self.monitor.start()

    async def authenticate(self, secret: str) -> Principal:
        if not self.monitor.down:
            try:
                ctx = await self._keys.authenticate(secret)
            except InvalidKeyError:
                self.known.refuse(secret, "revoked")
                raise
            except TenantSuspendedError:
                self.known.refuse(secret, "suspended")
                raise
            except Exception as error:
                self._degrade_or_raise(error)
            else:
                self.known.remember(secret, ctx)
                return self._principal(ctx)
        known = self.known.lookup(secret)
        if known is None:
            self.metrics.unverified_keys.inc()
            raise unavailable(
                "The tenant database is unreachable and this key was not verified recently.",
                RETRY_AFTER_S,
                code="database_unavailable",
            )
        return self._principal(known)

    async def admit(
        self,
        principal: Principal,
        request_id: str,
        prompt_tokens: int,
        max_tokens: int,
        *,
        model: str | None = None,
    ) -> Ticket:
        if not self._meter.healthy:
            # Work served now could not be billed: refuse it until usage is durable again.
            raise unavailable(
                "Usage cannot be recorded right now; retry shortly.",
                RETRY_AFTER_S,
                code="usage_unavailable",
            )
        ctx = self._contexts[principal.key_id or ""]
        ambiguous = False
        if not self.monitor.down:
            try:
                admission = await self._admission.admit(
                    ctx,
                    request_id,
                    prompt_tokens,
                    max_tokens,
                    model=model,
                    lease_id=None if self.lease is None else self.lease.lease_id,
                )
            except Exception as error:
                self._note_refusal(ctx.key_id, error)
                self._degrade_or_raise(error)
                ambiguous = True
            else:
                self.local.note_budget(ctx.tenant_id, admission.remaining_budget)
                self._rates[ctx.key_id] = (admission.rate, time.monotonic())
                return Ticket(request_id, principal, _headers(admission), admission)
        try:
            local = self.local.admit(
                ctx,
                request_id,
                prompt_tokens,
                max_tokens,
                outage=self.monitor.outages,
                ambiguous=ambiguous,
            )
        except Exception as error:
            self._note_refusal(ctx.key_id, error)
            raise
        self._rates[ctx.key_id] = (local.rate, time.monotonic())
        return Ticket(request_id, principal, _headers(local), local)

    def _note_refusal(self, key_id: str, error: Exception) -> None:
        rate = getattr(error, "rate", None)
        if isinstance(rate, RateState):
            self._rates[key_id] = (rate, time.monotonic())

    def rate_headers(self, principal: Principal) -> dict[str, str]:
        """The ``x-ratelimit-*`` of the key's last admission or refusal, refilled since; before
        the first, only its limits (the buckets' levels are in the database)."""
        key_id = principal.key_id or ""
        seen = self._rates.get(key_id)
        if seen is not None:
            rate, at = seen
            return ratelimit_headers(aged(rate, time.monotonic() - at))
        ctx = self._contexts.get(key_id)
        if ctx is None:
            return {}
        rpm, key_rpm = ctx.quotas.requests_per_minute, ctx.key_requests_per_minute
        if key_rpm is not None and (rpm is None or key_rpm < rpm):
            rpm = key_rpm
        return ratelimit_headers(
            RateState(limit_requests=rpm, limit_tokens=ctx.quotas.tokens_per_minute)
        )

    async def complete(self, ticket: Ticket, usage: UsageRecord) -> None:
        handle = ticket.handle
        event = UsageEvent(
            request_id=usage.request_id,
            tenant_id=usage.tenant_id,
            key_id=usage.key_id,
            model=usage.model,
            prompt_tokens=usage.prompt_tokens,
            cached_tokens=min(usage.cached_tokens, usage.prompt_tokens),
            completion_tokens=usage.completion_tokens,
            status=usage.status,  # type: ignore[arg-type]
            started_at=usage.started_at,
            finished_at=usage.finished_at,
            ttft_ms=None if usage.ttft_s is None else usage.ttft_s * 1000.0,
            duration_ms=(usage.finished_at - usage.started_at).total_seconds() * 1000.0,
            charge_budget=isinstance(handle, LocalTicket),
            batch_id=usage.batch_id,
        )
        actual = Usage(
            prompt_tokens=event.prompt_tokens,
            completion_tokens=event.completion_tokens,
            cached_tokens=event.cached_tokens,
        )
        if isinstance(handle, Admission):
            # The event is stored with the settlement, in one transaction; when that cannot
            # happen now (database away, or the reservation was already reclaimed), the meter
            # takes it (insert-or-ignore by request id keeps it one event).
            stored = False
            try:
                stored = await self._settle(handle, actual, event)
            finally:
                if not stored:
                    self._meter.record(event)
            return
        try:
            self._meter.record(event)
        finally:
            if isinstance(handle, LocalTicket):
                self.local.release(handle, actual.total_tokens)
                if handle.ambiguous:
                    # The event charges the tokens; settling with nothing only frees a
                    # reservation that the interrupted admission may have committed.
                    await self._settle(
                        _stray(handle, usage.started_at),
                        Usage(prompt_tokens=0, completion_tokens=0),
                    )

    def start_checkpoints(
        self, delivered: Callable[[], Iterable[tuple[Ticket, int]]], interval_s: float
    ) -> None:
        """Every ``interval_s``, record the output tokens delivered so far of the requests in
        flight (``delivered``: each one's ticket and count) on their reservations, so that a
        gateway that dies mid-answer is billed for them by whoever reclaims its lease."""

        async def run() -> None:
            while True:
                await asyncio.sleep(interval_s)
                try:
                    await self.checkpoint(delivered())
                except Exception as error:
                    if not self.monitor.report(error):
                        log.warning("usage_checkpoint_failed", error=repr(error))

        self._checkpointer = asyncio.create_task(run(), name="usage-checkpoints")

    async def checkpoint(self, delivered: Iterable[tuple[Ticket, int]]) -> None:
        """Record the counts of ``delivered`` that grew since they were last recorded (a
        request admitted while the database was away holds no reservation to record on)."""
        changed: dict[str, int] = {}
        seen: dict[str, int] = {}
        for ticket, tokens in delivered:
            if not isinstance(ticket.handle, Admission):
                continue
            request_id = ticket.handle.request_id
            last = self._checkpoints.get(request_id, 0)
            seen[request_id] = last
            if tokens > last:
                changed[request_id] = tokens
        self._checkpoints = seen  # the requests that ended are forgotten
        if not changed or self.monitor.down:
            return
        await self._admission.checkpoint(changed)
        self._checkpoints.update(changed)

    async def ready(self) -> bool:
        return await self.monitor.check()

    @property
    def usage_durable(self) -> bool:
        return self._meter.healthy

    async def stop_checkpoints(self) -> None:
        task, self._checkpointer = self._checkpointer, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def close(self) -> None:
        await self.stop_checkpoints()  # what is still running is settled from here on
        await self.monitor.stop()
        try:  # one last try, even in an outage: the database may be back already
            await self._retry_settles()
        except Exception as error:
            if not is_unavailable(error):
                raise
        if self._pending:
            log.warning("settles_abandoned", count=len(self._pending))
        await self._meter.flush()
        if self.lease is not None:
            await self.lease.stop()

    def _degrade_or_raise(self, error: Exception) -> None:
        """Return when ``error`` means the database is unreachable (serve degraded), else raise:
        a busy pool is 503 (retry soon), anything else propagates."""
        if self.monitor.report(error):
            return
        if isinstance(error, sa_exc.TimeoutError):
            raise unavailable(
                "The tenant database is busy; retry shortly.", 1.0, code="database_busy"
            ) from error
        raise error

    def batch_principal(self, ctx: AuthContext, batch_id: str, weight_fraction: float) -> Principal:
        """A Batch API line's principal: the key's, at ``weight_fraction`` of the tenant's
        weight, so the line yields to the tenant's interactive requests."""
        principal = self._principal(ctx)
        weight = principal.weight * weight_fraction
        return replace(principal, weight=weight, batch_id=batch_id, background=True)

    def _principal(self, ctx: AuthContext) -> Principal:
        self._contexts[ctx.key_id] = ctx
        return Principal(
            ctx.tenant_id,
            ctx.weight,
            key_id=ctx.key_id,
            kv_cache_share=ctx.quotas.kv_cache_share,
            scopes=ctx.scopes,
            models=ctx.models,
        )

    async def _settle(
        self, admission: Admission, usage: Usage, event: UsageEvent | None = None
    ) -> bool:
        """Settle now (True when ``event`` was stored with it) or queue it for the database's
        return (False)."""
        if not self.monitor.down:
            try:
                return await self._admission.settle(admission, usage, event)
            except Exception as error:
                if not self.monitor.report(error):
                    if event is None:
                        raise
                    # The usage row was refused: free the slot anyway; the meter keeps the event.
                    log.warning("settle_with_usage_failed", error=repr(error))
                    await self._settle(admission, usage)
                    return False
        self._pending[admission.request_id] = (admission, usage)
        self.metrics.pending_settles.set(len(self._pending))
        return False

    async def _retry_settles(self) -> None:
        """Settle what waited for the database (settle is idempotent per request id)."""
        for request_id, (admission, usage) in list(self._pending.items()):
            await self._admission.settle(admission, usage)
            del self._pending[request_id]
            self.metrics.pending_settles.set(len(self._pending))

    async def _sweep_refusals(self) -> None:
        """Learn of revocations and suspensions made elsewhere before an outage hides them, and
        restart the fallback age of the keys still valid."""
        key_ids = self.known.accepted_key_ids()
        if not key_ids:
            return
        asked_at = self.known.now()
        refusals = await self._keys.refused_keys(key_ids)
        gone = self.known.refuse_keys(refusals)
        self.known.confirm(key_ids - set(refusals), asked_at)
        for tenant_id, reason in gone.items():
            self.tenant_gone(tenant_id, reason)

    def key_revoked(self, key_id: str) -> None:
        """This gateway revoked ``key_id``: refused at once, even through an outage."""
        self.known.refuse_keys({key_id: "revoked"})

    def tenant_gone(self, tenant_id: str, reason: str) -> None:
        """``tenant_id`` is suspended or deleted: refuse its keys and drop its cached pages."""
        self.known.refuse_tenant(tenant_id, reason)
        for hook in self.on_tenant_gone:
            hook(tenant_id)


def _headers(grant: Admission | LocalTicket) -> dict[str, str]:
    return ratelimit_headers(grant.rate)


def _stray(ticket: LocalTicket, at: datetime) -> Admission:
    return Admission(
        request_id=ticket.request_id,
        tenant_id=ticket.tenant_id,
        key_id=ticket.key_id,
        reserved_tokens=ticket.reserved_tokens,
        period=month_period(at),
        admitted_at=at.astimezone(UTC),
    )


async def connect_sql_tenancy(
    settings: Settings, state: State
) -> tuple[SqlTenancy, LeaseKeeper, Callable[[], Awaitable[None]]]:
    """Open the tenant database (migrating the embedded SQLite default), start the meter, the
    lease (the owner of this gateway's reservations and batch claims) and the outage monitor,
    and leave the services on ``state`` for the admin API and the Batch API."""
    db = await Database.connect(settings.database_url)
    if db.dialect == "sqlite":  # a newer schema this code runs on stays (a rollback)
        await upgrade_unless_newer(db)
    secret = settings.server_secret.encode() if settings.server_secret else None
    domain = await TenantDomain.open(
        db, spool_path=Path(settings.usage_spool_path), key_secret=secret
    )
    await domain.meter.start()
    state.db = db
    limiter = state.get(AUTH_LIMITER)
    if isinstance(limiter, FailedAuthLimiter):  # failures count across gateways from now on
        limiter.shared = AuthFailureStore(db)
    state.tenant_domain = domain
    state.key_service = domain.keys
    state.tenant_service = domain.tenants
    state.audit_service = domain.audit
    metrics = state.get("metrics")
    registry = getattr(metrics, "registry", None)
    lease = LeaseKeeper(domain.leases, settings.gateway_lease_s)
    await lease.start()
    tenancy = SqlTenancy(
        domain.keys,
        domain.admission,
        domain.meter,
        db,
        registry=registry if isinstance(registry, CollectorRegistry) else None,
        per_tenant_metrics=settings.metrics_tenant_labels,
        lease=lease,
    )
    drop = getattr(state.get("engine"), "drop_tenant", None)
    if callable(drop):  # a suspended or deleted tenant's cached pages go at once
        tenancy.on_tenant_gone.append(drop)
    tenancy.start()
    state.batch_files = FileService(db)
    state.batch_store = BatchStore(db)

    async def close() -> None:
        await tenancy.stop_checkpoints()
        await tenancy.monitor.stop()
        await lease.stop()
        await domain.close()

    return tenancy, lease, close
