"""Admin API wire types not already defined by `tenants.schemas`/`tenants.records` (CONTRACT §3)."""

from __future__ import annotations

from datetime import datetime

import msgspec


class KeyCreate(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: str | None = None


class IssuedKey(msgspec.Struct, kw_only=True):
    """The one response that carries a key's secret."""

    id: str
    key: str
    prefix: str
    name: str
    created_at: datetime


class PublicPrefixCreate(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    text: str

    def __post_init__(self) -> None:
        if not self.text.strip():
            raise ValueError("text must not be empty")


class PublicPrefix(msgspec.Struct, kw_only=True):
    """A published prefix: how many tokens it has and how many are now cached for everyone."""

    num_tokens: int
    num_cached_tokens: int


class TenantEngineState(msgspec.Struct, kw_only=True):
    tenant_id: str
    tenant_name: str | None
    running: int
    waiting: int
    kv_pages_cached: int
    hit_rate: float | None


class EngineState(msgspec.Struct, kw_only=True):
    """The engine's live state as the console's overview draws it."""

    tokens_per_s: float
    num_running: int
    num_waiting: int
    kv_pages_total: int
    kv_pages_free: int
    hit_rate: float | None
    tenants: list[TenantEngineState]
