"""Metering, pricing, reporting and audit values (msgspec Structs)."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

import msgspec

from tenants.errors import InvalidInputError
from tenants.schemas import check_count, check_name

# "rejected" and "unavailable": refused by the engine before any token was computed (never
# billed); "gateway_lost": settled by another gateway after this one died (prompt tokens only).
EventStatus = Literal[
    "ok", "error", "disconnect", "rejected", "timeout", "unavailable", "gateway_lost"
]
Granularity = Literal["hour", "day"]
ExportFormat = Literal["csv", "jsonl"]


class UsageEvent(msgspec.Struct, frozen=True, kw_only=True):
    """One request's usage; exactly one row per ``request_id`` ever reaches the table."""

    request_id: str
    tenant_id: str
    key_id: str | None
    model: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    status: EventStatus
    started_at: datetime
    finished_at: datetime
    ttft_ms: float | None = None
    duration_ms: float | None = None
    # Admitted without a budget reservation (the database was unreachable): storing the event
    # charges its tokens to the monthly budget instead of a later settle.
    charge_budget: bool = False
    batch_id: str | None = None  # a batch line's usage: priced at the batch discount

    def __post_init__(self) -> None:
        if not self.request_id or not self.tenant_id or not self.model:
            raise InvalidInputError("request_id, tenant_id and model are required")
        for name in ("prompt_tokens", "cached_tokens", "completion_tokens"):
            check_count(getattr(self, name), name)
        if self.cached_tokens > self.prompt_tokens:
            raise InvalidInputError("cached_tokens exceeds prompt_tokens", "cached_tokens")
        if self.started_at.tzinfo is None or self.finished_at.tzinfo is None:
            raise InvalidInputError("event times must be timezone-aware", "started_at")


class PriceSet(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Prices per million tokens in integer micro-units of ``currency``."""

    input_per_million: int
    cached_input_per_million: int
    output_per_million: int
    currency: str = "USD"
    effective_from: datetime | None = None
    # Batch API lines cost this many percent less (0 to 100).
    batch_discount_percent: int = 0

    def __post_init__(self) -> None:
        for name in ("input_per_million", "cached_input_per_million", "output_per_million"):
            check_count(getattr(self, name), name)
        if not 0 <= self.batch_discount_percent <= 100:
            raise InvalidInputError(
                "batch_discount_percent must be between 0 and 100", "batch_discount_percent"
            )
        if len(self.currency) != 3 or not self.currency.isalpha() or not self.currency.isupper():
            raise InvalidInputError("currency must be a 3-letter ISO 4217 code", "currency")
        if self.effective_from is not None and self.effective_from.tzinfo is None:
            raise InvalidInputError("effective_from must carry a timezone", "effective_from")


class PriceInfo(msgspec.Struct, frozen=True, kw_only=True):
    model: str
    input_per_million: int
    cached_input_per_million: int
    output_per_million: int
    currency: str
    effective_from: datetime
    batch_discount_percent: int = 0


def check_model(model: str) -> None:
    check_name(model, "model")


class UsageBucket(msgspec.Struct, frozen=True, kw_only=True):
    tenant_id: str
    start: datetime
    requests: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


class ModelUsageBucket(msgspec.Struct, frozen=True, kw_only=True):
    """A ``UsageBucket`` of one model, with the tenant's name."""

    tenant_id: str
    tenant_name: str
    model: str
    start: datetime
    requests: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


class BillingRow(msgspec.Struct, frozen=True, kw_only=True):
    """One tenant and model (and currency) in an export; ``cost`` is ``cost_micros`` in units."""

    tenant_id: str
    tenant_name: str
    model: str
    requests: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    cost: str
    cost_micros: int
    currency: str


class BillingManifest(msgspec.Struct, frozen=True, kw_only=True):
    start: datetime
    end: datetime
    format: ExportFormat
    rows: int
    requests: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    cost_micros: dict[str, int]
    unpriced_requests: int
    sha256: str


class AuditRecord(msgspec.Struct, frozen=True, kw_only=True):
    id: int
    at: datetime
    actor: str
    action: str
    target: str
    before: dict[str, Any] | None
    after: dict[str, Any] | None
