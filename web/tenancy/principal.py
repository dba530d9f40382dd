"""What the gateway needs from the tenant domain: authenticate, admit, settle and meter usage.

`Tenancy` is the protocol the routes use; `InMemoryTenancy` serves tests, and `SqlTenancy`
(in ``web.tenancy.sql``) adapts the SQL services of `tenants/`, with a degraded mode.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Protocol

from tenants.errors import (
    InvalidKeyError,
    PromptTooLargeError,
    QuotaExceededError,
    TenantSuspendedError,
)
from tenants.rate_limit import RateState
from tenants.schemas import SCOPES


@dataclass(frozen=True, slots=True)
class Principal:
    """The tenant a request's key names; nothing in the body can name another."""

    tenant_id: str
    weight: float = 1.0
    key_id: str | None = None
    allow_public_prefix: bool = True
    kv_cache_share: float | None = None  # fraction of the KV cache its prefixes may keep
    scopes: tuple[str, ...] = SCOPES  # what the key may call: "inference", "usage:read"
    models: tuple[str, ...] | None = None  # the models the key may call; None: every model
    # Set on a Batch API line's principal (its weight is then a fraction of the tenant's).
    batch_id: str | None = None
    # Offline work (a Batch API line, here or at the gateway that sent it): its steps yield to
    # foreground prompts in the engine.
    background: bool = False
    # What the sender of an engine request counted of the tenant's requests (a gateway in
    # front of this engine): the engine's fair share sees a flood still on its way.
    tenant_requests: int = 0

    @property
    def engine_tenant_id(self) -> str:
        """Whom the engine's fair share charges: a tenant's batch lines count apart from its
        interactive requests, so their lower weight makes them yield to those."""
        return self.tenant_id if self.batch_id is None else f"{self.tenant_id}/batch"

    def allows_model(self, *names: str) -> bool:
        """Whether the key may call a model known by any of ``names`` (its name, an alias)."""
        return self.models is None or any(name in self.models for name in names)


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
    status: str  # "ok" | "error" | "disconnect" | "rejected" | "unavailable" (never billed)
    started_at: datetime
    finished_at: datetime
    key_id: str | None = None
    ttft_s: float | None = None
    batch_id: str | None = None


class Tenancy(Protocol):
    async def authenticate(self, secret: str) -> Principal:
        """Resolve a bearer key; raises InvalidKeyError or TenantSuspendedError."""
        ...

    async def admit(
        self,
        principal: Principal,
        request_id: str,
        prompt_tokens: int,
        max_tokens: int,
        *,
        model: str | None = None,
    ) -> Ticket:
        """Reserve capacity; raises PromptTooLargeError or QuotaExceededError."""
        ...

    async def complete(self, ticket: Ticket, usage: UsageRecord) -> None:
        """Settle the reservation with the actual usage and record the usage event once."""
        ...

    def rate_headers(self, principal: Principal) -> dict[str, str]:
        """The ``x-ratelimit-*`` headers the principal's errors carry, from what is in memory
        (no database read); empty for a tenant without per-minute limits."""
        ...

    async def ready(self) -> bool:
        """Whether the backing store answers."""
        ...

    @property
    def usage_durable(self) -> bool:
        """Whether usage events are being stored (or spooled); paid work stops while not."""
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
    usage_durable: bool = True

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
        self,
        principal: Principal,
        request_id: str,
        prompt_tokens: int,
        max_tokens: int,
        *,
        model: str | None = None,
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
                f"Concurrency limit reached: limit {cap} requests at once, {running} running.",
                reason="concurrency",
                retry_after_s=1.5,
                rate=RateState(limit_requests=cap, remaining_requests=0),
            )
        self.running[principal.tenant_id] = running + 1
        return Ticket(request_id, principal)

    async def complete(self, ticket: Ticket, usage: UsageRecord) -> None:
        tenant_id = ticket.principal.tenant_id
        self.running[tenant_id] = max(0, self.running.get(tenant_id, 0) - 1)
        self.usage.append(usage)
        if self.recorded is not None:
            self.recorded.set()

    def rate_headers(self, principal: Principal) -> dict[str, str]:
        return {}  # Its tenants have no per-minute limits.

    async def ready(self) -> bool:
        return not self.closed

    async def close(self) -> None:
        self.closed = True
