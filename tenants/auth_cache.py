"""Small TTL caches keyed by a key's HMAC (never the key itself): authenticated contexts, and
refused keys, so a flood of made-up keys costs one database query per key, not per request."""

from __future__ import annotations

import time
from collections.abc import Callable

from tenants.schemas import AuthContext

MAX_TTL_S = 1.0
REFUSAL_TTL_S = 5.0  # an unknown or revoked key stays refused without a query this long


class AuthCache:
    """Entries live at most ``ttl_s`` (≤ 1 s) so other processes' revocations apply quickly."""

    def __init__(
        self,
        ttl_s: float = MAX_TTL_S,
        max_entries: int = 10_000,
        monotonic: Callable[[], float] = time.monotonic,
        refusal_ttl_s: float = REFUSAL_TTL_S,
    ) -> None:
        if not 0.0 <= ttl_s <= MAX_TTL_S:
            raise ValueError(f"ttl_s must be within [0, {MAX_TTL_S}]")
        self._ttl_s = ttl_s
        self._refusal_ttl_s = refusal_ttl_s
        self._max_entries = max_entries
        self._monotonic = monotonic
        self._entries: dict[str, tuple[float, AuthContext]] = {}
        self._refused: dict[str, float] = {}  # key hash -> expiry, oldest first

    def refused(self, key_hash: str) -> bool:
        """Whether this key was refused (unknown or revoked) less than ``refusal_ttl_s`` ago."""
        expires_at = self._refused.get(key_hash)
        if expires_at is None:
            return False
        if self._monotonic() >= expires_at:
            del self._refused[key_hash]
            return False
        return True

    def refuse(self, key_hash: str) -> None:
        """Remember a refusal; past ``max_entries`` the oldest is forgotten (it re-queries)."""
        if self._refusal_ttl_s <= 0.0:
            return
        self._refused.pop(key_hash, None)
        while len(self._refused) >= self._max_entries:
            del self._refused[next(iter(self._refused))]
        self._refused[key_hash] = self._monotonic() + self._refusal_ttl_s

    def get(self, key_hash: str) -> AuthContext | None:
        entry = self._entries.get(key_hash)
        if entry is None:
            return None
        expires_at, ctx = entry
        if self._monotonic() >= expires_at:
            del self._entries[key_hash]
            return None
        return ctx

    def put(self, key_hash: str, ctx: AuthContext) -> None:
        if self._ttl_s == 0.0:
            return
        if len(self._entries) >= self._max_entries:
            self._entries.clear()  # bounded memory; the next requests simply re-query
        self._entries[key_hash] = (self._monotonic() + self._ttl_s, ctx)

    def drop_key(self, key_id: str) -> None:
        self._drop(lambda ctx: ctx.key_id == key_id)

    def drop_tenant(self, tenant_id: str) -> None:
        self._drop(lambda ctx: ctx.tenant_id == tenant_id)

    def _drop(self, match: Callable[[AuthContext], bool]) -> None:
        for key_hash in [h for h, (_, ctx) in self._entries.items() if match(ctx)]:
            del self._entries[key_hash]

    def __len__(self) -> int:
        return len(self._entries)
