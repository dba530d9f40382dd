"""What the gateway needs from the tenant domain: authenticate, admit, settle and meter usage.

`Tenancy` is the protocol the routes use; `InMemoryTenancy` serves tests, and `SqlTenancy` adapts
the SQL services of `tenants/`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

from litestar.datastructures import State

from tenants.admission import AdmissionService
from tenants.database import Database
from tenants.domain import TenantDomain
from tenants.errors import (
    InvalidKeyError,
    PromptTooLargeError,
    QuotaExceededError,
    TenantSuspendedError,
)
from tenants.key_service import KeyService
from tenants.records import UsageEvent
from tenants.schemas import Admission, AuthContext, Usage
from tenants.server_secrets import ensure_admin_token
from web.errors import ratelimit_headers
from web.settings import Settings


@dataclass(frozen=True, slots=True)
class Principal:
    """The tenant a request's key names; nothing in the body can name another."""

    tenant_id: str
    weight: float = 1.0
    key_id: str | None = None
    allow_public_prefix: bool = True
    kv_cache_share: float | None = None  # fraction of the KV cache its prefixes may keep


@dataclass(frozen=True, slots=True)
class Ticket:
    """An admitted request: its reservation (``handle``) and headers for the response."""

    request_id: str
    principal: Principal
    headers: Mapping[str, str] = field(default_factory=dict)
    handle: object | None = None


@dataclass(frozen=True, slots=True)
class UsageRecord:
    """One usage event per request id, written whatever way the request ended."""

    request_id: str
    tenant_id: str
    model: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    status: str  # "ok" | "error" | "disconnect"
    started_at: datetime
    finished_at: datetime
    key_id: str | None = None
    ttft_s: float | None = None


class Tenancy(Protocol):
    async def authenticate(self, secret: str) -> Principal:
        """Resolve a bearer key; raises InvalidKeyError or TenantSuspendedError."""
        ...

    async def admit(
        self, principal: Principal, request_id: str, prompt_tokens: int, max_tokens: int
    ) -> Ticket:
        """Reserve capacity; raises PromptTooLargeError or QuotaExceededError."""
        ...

    async def complete(self, ticket: Ticket, usage: UsageRecord) -> None:
        """Settle the reservation with the actual usage and record the usage event once."""
        ...

    async def ready(self) -> bool:
        """Whether the backing store answers."""
        ...

    async def close(self) -> None:
        """Flush pending usage events and release connections."""
        ...


@dataclass(slots=True)
class InMemoryTenant:
    tenant_id: str
    weight: float = 1.0
    suspended: bool = False
    max_prompt_tokens: int | None = None
    max_concurrent_requests: int | None = None


@dataclass(slots=True)
class InMemoryTenancy:
    """Keys and tenants held in memory; usage events are kept in ``usage`` in arrival order."""

    keys: dict[str, InMemoryTenant] = field(default_factory=dict)
    usage: list[UsageRecord] = field(default_factory=list)
    running: dict[str, int] = field(default_factory=dict)
    closed: bool = False
    recorded: asyncio.Event | None = None

    def add_key(self, secret: str, tenant: InMemoryTenant) -> None:
        self.keys[secret] = tenant

    async def authenticate(self, secret: str) -> Principal:
        tenant = self.keys.get(secret)
        if tenant is None:
            raise InvalidKeyError("Incorrect API key provided.")
        if tenant.suspended:
            raise TenantSuspendedError("This tenant is suspended.")
        return Principal(tenant.tenant_id, tenant.weight, key_id=f"key-{tenant.tenant_id}")

    async def admit(
        self, principal: Principal, request_id: str, prompt_tokens: int, max_tokens: int
    ) -> Ticket:
        tenant = next(t for t in self.keys.values() if t.tenant_id == principal.tenant_id)
        limit = tenant.max_prompt_tokens
        if limit is not None and prompt_tokens > limit:
            raise PromptTooLargeError(
                f"The prompt has {prompt_tokens} tokens; this tenant's limit is {limit}.",
                limit=limit,
                prompt_tokens=prompt_tokens,
            )
        running = self.running.get(principal.tenant_id, 0)
        cap = tenant.max_concurrent_requests
        if cap is not None and running >= cap:
            raise QuotaExceededError(
                "Too many concurrent requests.",
                reason="concurrency",
                retry_after_s=1.5,
                limit_requests=cap,
                remaining_requests=0,
            )
        self.running[principal.tenant_id] = running + 1
        return Ticket(request_id, principal)

    async def complete(self, ticket: Ticket, usage: UsageRecord) -> None:
        tenant_id = ticket.principal.tenant_id
        self.running[tenant_id] = max(0, self.running.get(tenant_id, 0) - 1)
        self.usage.append(usage)
        if self.recorded is not None:
            self.recorded.set()

    async def ready(self) -> bool:
        return not self.closed

    async def close(self) -> None:
        self.closed = True


class SqlTenancy:
    """The tenant domain in SQL: keys, admission with reservations, and the usage meter."""

    def __init__(self, keys: KeyService, admission: AdmissionService, meter: Any, db: Any) -> None:
        self._keys = keys
        self._admission = admission
        self._meter = meter
        self._db = db
        self._contexts: dict[str, AuthContext] = {}

    async def authenticate(self, secret: str) -> Principal:
        ctx = await self._keys.authenticate(secret)
        self._contexts[ctx.key_id] = ctx
        return Principal(
            ctx.tenant_id,
            ctx.weight,
            key_id=ctx.key_id,
            kv_cache_share=ctx.quotas.kv_cache_share,
        )

    async def admit(
        self, principal: Principal, request_id: str, prompt_tokens: int, max_tokens: int
    ) -> Ticket:
        ctx = self._contexts[principal.key_id or ""]
        admission = await self._admission.admit(ctx, request_id, prompt_tokens, max_tokens)
        headers = ratelimit_headers(
            admission.limit_requests,
            admission.remaining_requests,
            admission.limit_tokens,
            admission.remaining_tokens,
        )
        return Ticket(request_id, principal, headers, admission)

    async def complete(self, ticket: Ticket, usage: UsageRecord) -> None:
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
        )
        try:
            self._meter.record(event)
        finally:
            if isinstance(ticket.handle, Admission):
                actual = Usage(
                    prompt_tokens=event.prompt_tokens,
                    completion_tokens=event.completion_tokens,
                    cached_tokens=event.cached_tokens,
                )
                await self._admission.settle(ticket.handle, actual)

    async def ready(self) -> bool:
        return bool(await self._db.ping())

    async def close(self) -> None:
        await self._meter.flush()


async def connect_sql_tenancy(
    settings: Settings, state: State
) -> tuple[SqlTenancy, Callable[[], Awaitable[None]]]:
    """Open the tenant database (migrating the embedded SQLite default), start the meter and
    leave the services on ``state`` for the admin API."""
    db = await Database.connect(settings.database_url)
    if db.dialect == "sqlite":
        await db.upgrade()
    secret = settings.server_secret.encode() if settings.server_secret else None
    domain = await TenantDomain.open(
        db, spool_path=Path(settings.usage_spool_path), key_secret=secret
    )
    await domain.meter.start()
    generated = await ensure_admin_token(db, settings.admin_token)
    if generated is not None:
        # Shown once: only its hash is stored.
        print(f"Admin token (shown once): {generated}", flush=True)
    state.db = db
    state.tenant_domain = domain
    state.key_service = domain.keys
    state.tenant_service = domain.tenants
    state.audit_service = domain.audit
    return SqlTenancy(domain.keys, domain.admission, domain.meter, db), domain.close
