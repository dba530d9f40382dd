"""API keys: issue, list (never the secret), revoke, and authenticate a bearer key."""

from __future__ import annotations

import asyncio
from collections.abc import Collection
from datetime import timedelta

from sqlalchemy import or_, select, update
from sqlalchemy.exc import IntegrityError

from tenants.audit import add_entry
from tenants.auth_cache import AuthCache
from tenants.database import Database
from tenants.errors import (
    InvalidInputError,
    InvalidKeyError,
    KeyNotFoundError,
    TenantSuspendedError,
)
from tenants.key_format import generate_key, hash_key, key_matches, new_id, parse_prefix
from tenants.models import ApiKey, Tenant
from tenants.schemas import AuthContext, KeyInfo, check_name
from tenants.tenant_service import load_tenant, quotas_of, tenant_info
from tenants.timeutil import Clock, utc_now

LAST_USED_RESOLUTION = timedelta(minutes=1)  # bounds the writes authentication makes
REFUSAL_CHUNK = 500  # key ids per query of ``refused_keys``


def key_info(row: ApiKey) -> KeyInfo:
    return KeyInfo(
        id=row.id,
        tenant_id=row.tenant_id,
        name=row.name,
        prefix=row.prefix,
        created_at=row.created_at,
        revoked_at=row.revoked_at,
        last_used_at=row.last_used_at,
    )


class KeyService:
    def __init__(
        self, db: Database, server_secret: bytes, cache: AuthCache, clock: Clock = utc_now
    ) -> None:
        self._db = db
        self._secret = server_secret
        self._cache = cache
        self._clock = clock
        # Lookups in flight by key hash: requests arriving together with a key that is not
        # cached share one database query instead of sending one each.
        self._lookups: dict[str, asyncio.Future[AuthContext]] = {}

    async def create_key(
        self, tenant_id: str, name: str = "default", *, actor: str = "admin"
    ) -> tuple[KeyInfo, str]:
        """A new key for a live tenant: its info and the secret, shown this once only."""
        check_name(name)
        for _ in range(3):  # a prefix collision is astronomically rare; retry a little
            prefix, secret = generate_key()
            now = self._clock()
            row = ApiKey(
                id=new_id("key"),
                tenant_id=tenant_id,
                name=name,
                prefix=prefix,
                key_hash=hash_key(self._secret, secret),
                created_at=now,
            )
            try:
                async with self._db.transaction() as session:
                    await load_tenant(session, tenant_id)
                    session.add(row)
                    await session.flush()
                    info = key_info(row)
                    add_entry(
                        session,
                        at=now,
                        actor=actor,
                        action="key.create",
                        target=row.id,
                        before=None,
                        after=info,
                    )
            except IntegrityError:
                continue
            return info, secret
        raise InvalidInputError("could not allocate a unique key prefix")

    async def list_keys(self, tenant_id: str) -> list[KeyInfo]:
        async with self._db.sessions() as session:
            await load_tenant(session, tenant_id)
            rows = await session.scalars(
                select(ApiKey).where(ApiKey.tenant_id == tenant_id).order_by(ApiKey.created_at)
            )
            return [key_info(row) for row in rows]

    async def revoke_key(self, key_id: str, *, actor: str = "admin") -> KeyInfo:
        """Revoke a key; revoking twice keeps the first revocation time."""
        now = self._clock()
        async with self._db.transaction() as session:
            row = await session.scalar(select(ApiKey).where(ApiKey.id == key_id).with_for_update())
            if row is None:
                raise KeyNotFoundError(f"key {key_id!r} not found")
            before = key_info(row)
            if row.revoked_at is None:
                row.revoked_at = now
                after = key_info(row)
                add_entry(
                    session,
                    at=now,
                    actor=actor,
                    action="key.revoke",
                    target=key_id,
                    before=before,
                    after=after,
                )
            else:
                after = before
        self._cache.drop_key(key_id)
        return after

    async def authenticate(self, secret: str) -> AuthContext:
        """The context a bearer key speaks for.

        Raises InvalidKeyError (malformed, unknown, revoked) or TenantSuspendedError.
        """
        prefix = parse_prefix(secret)
        key_hash = hash_key(self._secret, secret)
        ctx = self._cache.get(key_hash)
        if ctx is None:
            ctx = await self._shared_lookup(key_hash, prefix, secret)
        if ctx.status != "active":
            raise TenantSuspendedError(f"tenant {ctx.tenant_id} is {ctx.status}")
        return ctx

    async def _shared_lookup(self, key_hash: str, prefix: str, secret: str) -> AuthContext:
        lookup = self._lookups.get(key_hash)
        if lookup is None:
            lookup = asyncio.ensure_future(self._lookup_and_cache(key_hash, prefix, secret))
            self._lookups[key_hash] = lookup
            lookup.add_done_callback(lambda done: self._lookup_done(key_hash, done))
        # Shielded: one caller giving up does not cancel the others' lookup.
        return await asyncio.shield(lookup)

    async def _lookup_and_cache(self, key_hash: str, prefix: str, secret: str) -> AuthContext:
        ctx = await self._lookup(prefix, secret)
        self._cache.put(key_hash, ctx)
        return ctx

    def _lookup_done(self, key_hash: str, done: asyncio.Future[AuthContext]) -> None:
        if self._lookups.get(key_hash) is done:
            del self._lookups[key_hash]
        if not done.cancelled():
            done.exception()  # retrieved here too, in case every caller has given up

    async def refused_keys(self, key_ids: Collection[str]) -> dict[str, str]:
        """Of ``key_ids``, those that would be refused now: ``"revoked"`` (also for a key that
        no longer exists) or their tenant's status (``"suspended"``, ``"deleted"``)."""
        ids = sorted(set(key_ids))
        refused = {key_id: "revoked" for key_id in ids}
        async with self._db.sessions() as session:
            for start in range(0, len(ids), REFUSAL_CHUNK):
                rows = await session.execute(
                    select(ApiKey.id, ApiKey.revoked_at, Tenant.status)
                    .join(Tenant, Tenant.id == ApiKey.tenant_id)
                    .where(ApiKey.id.in_(ids[start : start + REFUSAL_CHUNK]))
                )
                for key_id, revoked_at, status in rows:
                    if revoked_at is None and status == "active":
                        del refused[key_id]
                    elif revoked_at is None:
                        refused[key_id] = status
        return refused

    async def _lookup(self, prefix: str, secret: str) -> AuthContext:
        now = self._clock()
        async with self._db.sessions() as session:
            found = (
                await session.execute(
                    select(ApiKey, Tenant)
                    .join(Tenant, Tenant.id == ApiKey.tenant_id)
                    .where(ApiKey.prefix == prefix)
                )
            ).one_or_none()
            if found is None:
                raise InvalidKeyError("unknown API key")
            key, tenant = found
            if not key_matches(self._secret, secret, key.key_hash) or key.revoked_at is not None:
                raise InvalidKeyError("unknown or revoked API key")
            if key.last_used_at is None or key.last_used_at < now - LAST_USED_RESOLUTION:
                await session.execute(
                    update(ApiKey)
                    .where(ApiKey.id == key.id)
                    .where(
                        or_(
                            ApiKey.last_used_at.is_(None),
                            ApiKey.last_used_at < now - LAST_USED_RESOLUTION,
                        )
                    )
                    .values(last_used_at=now)
                )
                await session.commit()
            info = tenant_info(tenant)
            return AuthContext(
                tenant_id=info.id,
                tenant_name=info.name,
                key_id=key.id,
                weight=info.weight,
                status=info.status,
                quotas=quotas_of(tenant),
            )
