"""What a key may do and until when: scopes, a model list, a requests/min limit and expiry.

``KeySpec`` (a new key), ``KeyPatch`` (a change) and ``KeyRotate`` are the request shapes the
admin API decodes and the CLI builds; ``is_live`` is the one rule for "does this key work now".
"""

from __future__ import annotations

from datetime import datetime

import msgspec
from msgspec import UNSET, UnsetType

from tenants.errors import InvalidInputError
from tenants.schemas import SCOPES, Scope, check_count, check_name

MAX_MODELS = 32
MAX_OVERLAP_S = 90 * 24 * 3600  # a rotation's old key works at most 90 days more


def check_scopes(scopes: list[Scope]) -> None:
    if not scopes or len(set(scopes)) != len(scopes):
        raise InvalidInputError("scopes must be a non-empty list without repeats", "scopes")


def check_models(models: list[str] | None) -> None:
    if models is None:
        return
    if not models or len(models) > MAX_MODELS or len(set(models)) != len(models):
        raise InvalidInputError(
            f"models must be null (every model) or 1-{MAX_MODELS} distinct names", "models"
        )
    for model in models:
        check_name(model, "models")


def check_expiry(expires_at: datetime | None) -> None:
    if expires_at is not None and expires_at.tzinfo is None:
        raise InvalidInputError("expires_at must carry a timezone", "expires_at")


def scopes_text(scopes: list[Scope]) -> str:
    """The stored form: scopes in their canonical order, space-separated."""
    return " ".join(scope for scope in SCOPES if scope in scopes)


def scopes_of(text: str) -> list[Scope]:
    return [scope for scope in SCOPES if scope in text.split()]


def is_live(revoked_at: datetime | None, expires_at: datetime | None, now: datetime) -> bool:
    """A key works until it is revoked or its expiry (or rotation overlap) has passed."""
    return revoked_at is None and (expires_at is None or now < expires_at)


class KeySpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A new key: ``models`` None allows every model; ``requests_per_minute`` None: only the
    tenant's limit applies."""

    name: str = "default"
    expires_at: datetime | None = None
    scopes: list[Scope] = msgspec.field(default_factory=lambda: list(SCOPES))
    models: list[str] | None = None
    requests_per_minute: int | None = None

    def __post_init__(self) -> None:
        check_name(self.name)
        check_expiry(self.expires_at)
        check_scopes(self.scopes)
        check_models(self.models)
        check_count(self.requests_per_minute, "requests_per_minute")


class KeyPatch(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A change of a key: absent fields stay; ``None`` clears expiry, model list or limit."""

    name: str | UnsetType = UNSET
    expires_at: datetime | UnsetType | None = UNSET
    scopes: list[Scope] | UnsetType = UNSET
    models: list[str] | UnsetType | None = UNSET
    requests_per_minute: int | UnsetType | None = UNSET

    def __post_init__(self) -> None:
        if self.name is not UNSET:
            check_name(self.name)
        if self.expires_at is not UNSET:
            check_expiry(self.expires_at)
        if self.scopes is not UNSET:
            check_scopes(self.scopes)
        if self.models is not UNSET:
            check_models(self.models)
        if self.requests_per_minute is not UNSET:
            check_count(self.requests_per_minute, "requests_per_minute")


class KeyRotate(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Rotation: the old key keeps working ``overlap_seconds`` more (0: it stops at once); the
    new key copies its name, scopes, models and limit, and expires at ``expires_at``."""

    overlap_seconds: int = 3600
    expires_at: datetime | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.overlap_seconds <= MAX_OVERLAP_S:
            raise InvalidInputError(
                f"overlap_seconds must be between 0 and {MAX_OVERLAP_S}", "overlap_seconds"
            )
        check_expiry(self.expires_at)
