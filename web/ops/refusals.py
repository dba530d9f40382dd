"""The refusals this gateway answered for known tenants (quotas, budgets, a suspended tenant, a
prompt over its limit, a database it could not reach), kept in memory for the console: counts
by tenant and reason since start, and the latest few with their message.

/metrics counts refusals by reason only, never by tenant; this log names tenants, and is read
only through the admin API.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from datetime import UTC, datetime

import msgspec

from tenants.errors import QuotaExceededError
from web.ops.errors import to_api_error

RECENT = 1000  # refusals kept with their message, newest last
REFUSAL_STATUSES = frozenset({403, 413, 429, 503})


class Refusal(msgspec.Struct, frozen=True, kw_only=True):
    at: datetime
    tenant_id: str
    key_id: str | None
    status: int
    reason: str  # the quota that refused (``monthly_token_budget``), else the error code
    message: str
    batch: bool  # a Batch API line (retried later), not an interactive request


class RefusalCount(msgspec.Struct, frozen=True, kw_only=True):
    tenant_id: str
    reason: str
    count: int


@dataclass(slots=True)
class RefusalLog:
    since: datetime = field(default_factory=lambda: datetime.now(UTC))
    recent: collections.deque[Refusal] = field(
        default_factory=lambda: collections.deque(maxlen=RECENT)
    )
    counts: collections.Counter[tuple[str, str]] = field(default_factory=collections.Counter)

    def record(
        self, tenant_id: str, key_id: str | None, error: Exception, *, batch: bool = False
    ) -> Refusal | None:
        """Log ``error`` if it is a refusal (what the client gets as 403, 413, 429 or 503)."""
        api_error = to_api_error(error)
        if api_error.status_code not in REFUSAL_STATUSES:
            return None
        reason = error.reason if isinstance(error, QuotaExceededError) else api_error.code
        refusal = Refusal(
            at=datetime.now(UTC),
            tenant_id=tenant_id,
            key_id=key_id,
            status=api_error.status_code,
            reason=reason or "unknown",
            message=api_error.message,
            batch=batch,
        )
        self.recent.append(refusal)
        self.counts[(tenant_id, refusal.reason)] += 1
        return refusal

    def latest(self, tenant_id: str | None = None, limit: int = 50) -> list[Refusal]:
        """The newest refusals first (of one tenant, or of all)."""
        found: list[Refusal] = []
        for refusal in reversed(self.recent):
            if tenant_id is None or refusal.tenant_id == tenant_id:
                found.append(refusal)
                if len(found) >= limit:
                    break
        return found

    def totals(self, tenant_id: str | None = None) -> list[RefusalCount]:
        """Refusals since start by tenant and reason, most first."""
        return [
            RefusalCount(tenant_id=tenant, reason=reason, count=count)
            for (tenant, reason), count in self.counts.most_common()
            if tenant_id is None or tenant == tenant_id
        ]
