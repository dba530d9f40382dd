"""The engine role's stand-in for the tenant domain: it admits whatever its gateway sent.

Quotas, budgets and metering happen at the gateway, against the database; an engine has no
database and never sees an API key. What a tenant is, it learns from the request's tenant
fields (``web.engine_api.wire``), which only an engine-token holder can send.
"""

from __future__ import annotations

from dataclasses import dataclass

from tenants.errors import InvalidKeyError
from web.tenancy.principal import Principal, Ticket, UsageRecord


@dataclass(slots=True)
class TrustedTenancy:
    """Admits every request as the principal it was given; usage is the gateway's to record."""

    closed: bool = False
    usage_durable: bool = True

    async def authenticate(self, secret: str) -> Principal:
        raise InvalidKeyError("An engine takes no API keys.")

    async def admit(
        self,
        principal: Principal,
        request_id: str,
        prompt_tokens: int,
        max_tokens: int,
        *,
        model: str | None = None,
    ) -> Ticket:
        return Ticket(request_id, principal)

    async def complete(self, ticket: Ticket, usage: UsageRecord) -> None:
        return None

    def rate_headers(self, principal: Principal) -> dict[str, str]:
        return {}  # Limits are the gateway's.

    async def ready(self) -> bool:
        return not self.closed

    async def close(self) -> None:
        self.closed = True
