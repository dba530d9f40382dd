"""Admin API wire types not already defined by `tenants.schemas`/`tenants.records` (CONTRACT §3)."""

from __future__ import annotations

from datetime import datetime

import msgspec

from tenants.key_policy import KeySpec
from tenants.schemas import SCOPES, KeyInfo, Scope


class KeyCreate(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A new key: absent fields give a key for every model and scope, without expiry or limit."""

    name: str | None = None
    expires_at: datetime | None = None
    scopes: list[Scope] = msgspec.field(default_factory=lambda: list(SCOPES))
    models: list[str] | None = None
    requests_per_minute: int | None = None

    def spec(self, default_name: str) -> KeySpec:
        return KeySpec(
            name=default_name if self.name is None else self.name,
            expires_at=self.expires_at,
            scopes=self.scopes,
            models=self.models,
            requests_per_minute=self.requests_per_minute,
        )


class IssuedKey(msgspec.Struct, kw_only=True):
    """The one response that carries a key's secret; ``replaces`` names the key a rotation
    retires (which works until ``replaces_until``)."""

    id: str
    key: str
    prefix: str
    name: str
    created_at: datetime
    expires_at: datetime | None
    scopes: list[Scope]
    models: list[str] | None
    requests_per_minute: int | None
    replaces: str | None = None
    replaces_until: datetime | None = None

    @classmethod
    def of(cls, info: KeyInfo, secret: str, retired: KeyInfo | None = None) -> IssuedKey:
        return cls(
            id=info.id,
            key=secret,
            prefix=info.prefix,
            name=info.name,
            created_at=info.created_at,
            expires_at=info.expires_at,
            scopes=info.scopes,
            models=info.models,
            requests_per_minute=info.requests_per_minute,
            replaces=None if retired is None else retired.id,
            replaces_until=None if retired is None else retired.expires_at,
        )


class PublicPrefixCreate(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    text: str

    def __post_init__(self) -> None:
        if not self.text.strip():
            raise ValueError("text must not be empty")


class PublicPrefix(msgspec.Struct, kw_only=True):
    """A public prefix as stored, with what this gateway's engine holds of it: its tokens and
    those cached for every tenant (null where this gateway runs no engine of its own, or for an
    unpublished prefix), or why the engine could not keep it."""

    id: str
    text: str
    created_at: datetime
    created_by: str
    unpublished_at: datetime | None
    unpublished_by: str | None
    num_tokens: int | None = None
    num_cached_tokens: int | None = None
    engine_error: str | None = None


class TenantEngineState(msgspec.Struct, kw_only=True):
    tenant_id: str
    tenant_name: str | None
    running: int
    waiting: int
    kv_pages_cached: int
    hit_rate: float | None


class EngineInstanceState(msgspec.Struct, kw_only=True):
    """One engine as last seen: ``url`` is ``local`` for the gateway's own engine process."""

    url: str
    healthy: bool
    tokens_per_s: float
    num_running: int
    num_waiting: int
    kv_pages_total: int
    kv_pages_free: int
    hit_rate: float | None
    kv_pages_cached: int = 0  # evictable pages the prefix cache holds
    num_preemptions: int = 0  # since the engine started
    draft_acceptance: float | None = None  # accepted / drafted tokens; None without drafting
    tenants: list[TenantEngineState] = msgspec.field(default_factory=list)


class EngineState(msgspec.Struct, kw_only=True):
    """The engines' live state as the console's overview draws it: the numbers summed over
    every engine, per tenant, and per engine in ``engines``."""

    tokens_per_s: float
    num_running: int
    num_waiting: int
    kv_pages_total: int
    kv_pages_free: int
    hit_rate: float | None
    tenants: list[TenantEngineState]
    engines: list[EngineInstanceState] = msgspec.field(default_factory=list)
