"""Last-known-good authentication: keys verified against the database, served while it is down.

Entries are keyed by an HMAC of the key under a per-process random salt (never the key itself),
bounded in number and age; a key found revoked, or whose tenant was suspended, stays refused.
An entry's age counts from the database's last word on it (a request, or a sweep that found it
still valid), so a key revoked elsewhere just before an outage is served at most ``max_age_s``.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime

from tenants.errors import InvalidKeyError, TenantSuspendedError
from tenants.schemas import AuthContext

MAX_AGE_S = 60.0
MAX_ENTRIES = 10_000


@dataclass(frozen=True, slots=True)
class KnownKey:
    """What the database last said about one key, and when (monotonic seconds)."""

    verified_at: float
    ctx: AuthContext
    refusal: str | None = None  # "revoked", or the tenant's status when it is not active


class KnownKeys:
    """The keys this process verified lately; ``lookup`` answers as the database last did."""

    def __init__(
        self,
        max_age_s: float = MAX_AGE_S,
        max_entries: int = MAX_ENTRIES,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._max_age_s = max_age_s
        self._max_entries = max_entries
        self._monotonic = monotonic
        self._salt = secrets.token_bytes(32)
        self._entries: OrderedDict[str, KnownKey] = OrderedDict()  # oldest verification first

    def now(self) -> float:
        """This cache's clock (monotonic seconds), for ``confirm``."""
        return self._monotonic()

    def remember(self, secret: str, ctx: AuthContext) -> None:
        """The database just accepted ``secret`` for ``ctx``."""
        self._put(self._digest(secret), KnownKey(self._monotonic(), ctx))

    def refuse(self, secret: str, reason: str) -> None:
        """The database just refused ``secret``; only keys once accepted are remembered."""
        digest = self._digest(secret)
        entry = self._entries.get(digest)
        if entry is not None:
            self._put(digest, KnownKey(self._monotonic(), entry.ctx, reason))

    def refuse_keys(self, refusals: Mapping[str, str]) -> dict[str, str]:
        """Mark the entries of these key ids refused (``key_id -> reason``); returns the tenants
        whose keys were newly refused for a reason other than revocation (``tenant -> reason``)."""
        gone: dict[str, str] = {}
        for digest, entry in list(self._entries.items()):
            reason = refusals.get(entry.ctx.key_id)
            if reason is not None and entry.refusal is None:
                self._entries[digest] = KnownKey(entry.verified_at, entry.ctx, reason)
                if reason != "revoked":
                    gone[entry.ctx.tenant_id] = reason
        return gone

    def refuse_tenant(self, tenant_id: str, reason: str) -> None:
        """Mark every entry of ``tenant_id`` refused (suspended or deleted here, just now)."""
        for digest, entry in list(self._entries.items()):
            if entry.ctx.tenant_id == tenant_id and entry.refusal is None:
                self._entries[digest] = KnownKey(entry.verified_at, entry.ctx, reason)

    def confirm(self, key_ids: set[str], at: float) -> None:
        """The database said at ``at`` (monotonic, taken before asking) that these keys were
        still valid: their age counts from then."""
        for digest, entry in list(self._entries.items()):
            if entry.ctx.key_id in key_ids and entry.refusal is None and entry.verified_at < at:
                self._entries[digest] = KnownKey(at, entry.ctx)
                self._entries.move_to_end(digest)

    def accepted_key_ids(self) -> set[str]:
        return {e.ctx.key_id for e in self._entries.values() if e.refusal is None}

    def lookup(self, secret: str) -> AuthContext | None:
        """The context last verified for ``secret``, None when unknown or too old; raises
        InvalidKeyError or TenantSuspendedError for a key the database last refused."""
        self._expire()
        entry = self._entries.get(self._digest(secret))
        if entry is None or self._monotonic() - entry.verified_at > self._max_age_s:
            return None
        if entry.refusal == "revoked":
            raise InvalidKeyError("unknown or revoked API key")
        if entry.refusal is not None:
            raise TenantSuspendedError(f"tenant {entry.ctx.tenant_id} is {entry.refusal}")
        expires_at = entry.ctx.expires_at
        if expires_at is not None and datetime.now(UTC) >= expires_at:
            raise InvalidKeyError("API key expired")
        return entry.ctx

    def __len__(self) -> int:
        return len(self._entries)

    def _digest(self, secret: str) -> str:
        return hmac.new(self._salt, secret.encode(), hashlib.sha256).hexdigest()

    def _put(self, digest: str, entry: KnownKey) -> None:
        self._entries.pop(digest, None)
        self._entries[digest] = entry
        while len(self._entries) > self._max_entries:
            self._entries.popitem(last=False)

    def _expire(self) -> None:
        # Mostly oldest first (a sweep's confirmation can land after a newer request's):
        # lookup checks each entry's own age, this only bounds memory.
        oldest_allowed = self._monotonic() - self._max_age_s
        while self._entries:
            digest, entry = next(iter(self._entries.items()))
            if entry.verified_at >= oldest_allowed:
                return
            del self._entries[digest]
