"""Values the tenant services take and return (msgspec Structs; ORM rows never leave a service).

Request-shaped structs forbid unknown fields so the gateway can decode JSON bodies into them.
"""

from __future__ import annotations

import math
import re
import unicodedata
from datetime import datetime
from typing import Annotated, Literal

import msgspec
from msgspec import UNSET, UnsetType

from tenants.errors import InvalidInputError
from tenants.rate_limit import RateState

TenantStatus = Literal["active", "suspended", "deleted"]
PatchableStatus = Literal["active", "suspended"]
Scope = Literal["inference", "usage:read"]  # what a key may call: generation, its own usage
SCOPES: tuple[Scope, ...] = ("inference", "usage:read")
MAX_NAME_LEN = 100
# A tenant's name is a handle typed on command lines (``atrium keys create acme``) and read in
# URLs, exports and logs: lowercase letters, digits, ``.``, ``_`` and ``-``, at most 63, starting
# with a letter or digit; never ``tn_…``, which is how ids look. Names stored before the rule
# keep working; ``TenantService.create`` holds new tenants to it (there, a refusal names the
# rule in the admin API's answer; a struct's own check would reach it as a bare 400).
TENANT_NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,62}")
TENANT_NAME_RULE = (
    "name must be 1-63 lowercase letters, digits, '.', '_' or '-', starting with a letter or "
    "digit, and not 'tn_…' (e.g. acme or acme-prod)"
)
QUOTA_FIELDS = (
    "requests_per_minute",
    "tokens_per_minute",
    "max_concurrent_requests",
    "monthly_token_budget",
    "monthly_cost_budget",
    "max_prompt_tokens",
)


MAX_QUOTA_MODELS = 64


def check_model_list(models: tuple[str, ...] | None) -> None:
    """A tenant's model allow-list: None (every model) or 1-64 distinct served names."""
    if models is None:
        return
    if not models or len(models) > MAX_QUOTA_MODELS or len(set(models)) != len(models):
        raise InvalidInputError(
            f"models must be null (every model) or 1-{MAX_QUOTA_MODELS} distinct names", "models"
        )
    for model in models:
        check_name(model, "models")


# The largest count or price accepted: exact in JSON doubles and far from SQL's 64-bit limit,
# so sums of such values cannot overflow a BIGINT column either.
MAX_COUNT = 2**53


def check_count(value: int | None, param: str) -> None:
    if value is not None and (isinstance(value, bool) or not 0 <= value <= MAX_COUNT):
        raise InvalidInputError(
            f"{param} must be an integer between 0 and {MAX_COUNT}, or null", param
        )


def check_share(value: float | None) -> None:
    if value is not None and not (math.isfinite(value) and 0.0 <= value <= 1.0):
        raise InvalidInputError("kv_cache_share must be between 0 and 1", "kv_cache_share")


def check_weight(value: float) -> None:
    if not (math.isfinite(value) and 0.0 < value <= 1e6):
        raise InvalidInputError("weight must be a positive finite number", "weight")


def check_name(value: str, param: str = "name") -> None:
    if not value.strip() or len(value) > MAX_NAME_LEN or value != value.strip():
        raise InvalidInputError(f"{param} must be 1-{MAX_NAME_LEN} characters, untrimmed", param)
    # Control characters (NUL above all: PostgreSQL text cannot hold it) and lone surrogates
    # (not UTF-8) have no place in a name that is stored, logged and exported.
    if any(unicodedata.category(c) in ("Cc", "Cs") for c in value):
        raise InvalidInputError(f"{param} must not contain control characters", param)


def check_tenant_name(value: str) -> None:
    """A new tenant's name follows ``TENANT_NAME``; InvalidInputError otherwise."""
    if not TENANT_NAME.fullmatch(value) or value.startswith("tn_"):
        raise InvalidInputError(f"{TENANT_NAME_RULE}; got {value[:80]!r}", "name")


class Quotas(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Per-tenant limits; ``None`` means unlimited."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent_requests: int | None = None
    monthly_token_budget: int | None = None
    # Micro-units of the price table's currency (25_000_000 is 25.00), priced at the model's
    # price: reserved at the worst case on admission, charged what was used on settlement.
    monthly_cost_budget: int | None = None
    max_prompt_tokens: int | None = None
    kv_cache_share: float | None = None
    # The models (served names, adapters) the tenant's keys may call; None: every model.
    models: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        for field in QUOTA_FIELDS:
            check_count(getattr(self, field), field)
        check_share(self.kv_cache_share)
        check_model_list(self.models)


class QuotasPatch(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A partial change of quotas: absent fields stay, ``None`` sets unlimited."""

    requests_per_minute: int | UnsetType | None = UNSET
    tokens_per_minute: int | UnsetType | None = UNSET
    max_concurrent_requests: int | UnsetType | None = UNSET
    monthly_token_budget: int | UnsetType | None = UNSET
    monthly_cost_budget: int | UnsetType | None = UNSET
    max_prompt_tokens: int | UnsetType | None = UNSET
    kv_cache_share: float | UnsetType | None = UNSET
    models: tuple[str, ...] | UnsetType | None = UNSET

    def apply(self, quotas: Quotas) -> Quotas:
        changes = {
            name: value
            for name in (*QUOTA_FIELDS, "kv_cache_share", "models")
            if (value := getattr(self, name)) is not UNSET
        }
        return msgspec.structs.replace(quotas, **changes)


class TenantCreate(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    name: Annotated[str, msgspec.Meta(description=TENANT_NAME_RULE)]
    weight: float = 1.0
    quotas: Quotas = msgspec.field(default_factory=Quotas)

    def __post_init__(self) -> None:
        check_name(self.name)  # the service holds a new tenant to ``check_tenant_name``
        check_weight(self.weight)


class TenantPatch(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    weight: float | UnsetType = UNSET
    status: PatchableStatus | UnsetType = UNSET
    quotas: QuotasPatch | UnsetType = UNSET

    def __post_init__(self) -> None:
        if self.weight is not UNSET:
            check_weight(self.weight)
        if self.status is not UNSET and self.status not in ("active", "suspended"):
            raise InvalidInputError("status must be active or suspended", "status")


class TenantInfo(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    name: str
    weight: float
    status: TenantStatus
    created_at: datetime
    quotas: Quotas


class KeyInfo(msgspec.Struct, frozen=True, kw_only=True):
    """An API key without its secret."""

    id: str
    tenant_id: str
    name: str
    prefix: str
    created_at: datetime
    revoked_at: datetime | None = None
    last_used_at: datetime | None = None
    expires_at: datetime | None = None
    replaced_by: str | None = None  # the key a rotation issued in its place
    scopes: list[Scope] = msgspec.field(default_factory=lambda: list(SCOPES))
    models: list[str] | None = None  # None: every model
    requests_per_minute: int | None = None  # None: only the tenant's limit


class AuthContext(msgspec.Struct, frozen=True, kw_only=True):
    """Who a valid key speaks for; the only tenant identity a request may carry."""

    tenant_id: str
    tenant_name: str
    key_id: str
    weight: float
    status: TenantStatus
    quotas: Quotas
    expires_at: datetime | None = None  # checked on every request, cached or not
    scopes: tuple[Scope, ...] = SCOPES
    models: tuple[str, ...] | None = None  # None: every model
    key_requests_per_minute: int | None = None

    def allows_model(self, *names: str) -> bool:
        """Whether the key may call a model known by any of ``names`` (its name, an alias)."""
        return self.models is None or any(name in self.models for name in names)


class Admission(msgspec.Struct, frozen=True, kw_only=True):
    """A granted request: what it holds until ``settle`` (a concurrency slot, reserved tokens).

    The limit/remaining fields feed the ``x-ratelimit-*`` headers of a successful response.
    """

    request_id: str
    tenant_id: str
    key_id: str
    reserved_tokens: int
    period: str
    admitted_at: datetime
    limit_requests: int | None = None
    remaining_requests: int | None = None
    reset_requests_s: float | None = None  # until the requests bucket is full again
    limit_tokens: int | None = None
    remaining_tokens: int | None = None
    reset_tokens_s: float | None = None
    # The month's budget left after this reservation (None: no budget): the most a gateway
    # lets this tenant spend on its own while the database is unreachable.
    remaining_budget: int | None = None

    @property
    def rate(self) -> RateState:
        return RateState(
            self.limit_requests,
            self.remaining_requests,
            self.reset_requests_s,
            self.limit_tokens,
            self.remaining_tokens,
            self.reset_tokens_s,
        )


class Usage(msgspec.Struct, frozen=True, kw_only=True):
    """What a finished request actually used (``prompt_tokens`` includes ``cached_tokens``)."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    def __post_init__(self) -> None:
        for name in ("prompt_tokens", "completion_tokens", "cached_tokens"):
            check_count(getattr(self, name), name)
        if self.cached_tokens > self.prompt_tokens:
            raise InvalidInputError("cached_tokens exceeds prompt_tokens", "cached_tokens")

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens
