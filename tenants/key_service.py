"""API keys: issue, list (never the secret), change, rotate, revoke; authenticate a bearer key."""

from __future__ import annotations

import asyncio
from collections.abc import Collection
from datetime import datetime, timedelta

from msgspec import UNSET
from sqlalchemy import or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from tenants.audit import add_entry
from tenants.auth_cache import AuthCache
from tenants.database import Database
from tenants.errors import (
    ConflictError,
    InvalidInputError,
    InvalidKeyError,
    TenantSuspendedError,
)
from tenants.key_format import generate_key, hash_key, key_matches, new_id, parse_prefix
from tenants.key_policy import KeyPatch, KeyRotate, KeySpec, is_live, scopes_text
from tenants.key_rows import auth_context, key_info, load_key
from tenants.models import ApiKey, Tenant
from tenants.schemas import AuthContext, KeyInfo
from tenants.tenant_service import load_tenant
from tenants.timeutil import Clock, utc_now

LAST_USED_RESOLUTION = timedelta(minutes=1)  # bounds the writes authentication makes
REFUSAL_CHUNK = 500  # key ids per query of ``refused_keys``


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
        self, tenant_id: str, spec: KeySpec | str = "default", *, actor: str = "admin"
    ) -> tuple[KeyInfo, str]:
        """A new key for a live tenant: its info and the secret, shown this once only."""
        spec = KeySpec(name=spec) if isinstance(spec, str) else spec
        for _ in range(3):  # a prefix collision is astronomically rare; retry a little
            try:
                async with self._db.transaction() as session:
                    await load_tenant(session, tenant_id)
                    return await self._issue(session, tenant_id, spec, actor, self._clock())
            except IntegrityError:
                continue
        raise InvalidInputError("could not allocate a unique key prefix")

    async def _issue(
        self, session: AsyncSession, tenant_id: str, spec: KeySpec, actor: str, now: datetime
    ) -> tuple[KeyInfo, str]:
        prefix, secret = generate_key()
        row = ApiKey(
            id=new_id("key"),
            tenant_id=tenant_id,
            name=spec.name,
            prefix=prefix,
            key_hash=hash_key(self._secret, secret),
            created_at=now,
            expires_at=spec.expires_at,
            scopes=scopes_text(spec.scopes),
            models=spec.models,
            requests_per_minute=spec.requests_per_minute,
        )
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
        return info, secret

    async def get_key(self, key_id: str) -> KeyInfo:
        async with self._db.sessions() as session:
            return key_info(await load_key(session, key_id))

    async def update_key(self, key_id: str, patch: KeyPatch, *, actor: str = "admin") -> KeyInfo:
        """Change a key's name, expiry, scopes, models or limit; a revoked key cannot change."""
        now = self._clock()
        async with self._db.transaction() as session:
            row = await load_key(session, key_id, lock=True)
            if row.revoked_at is not None:
                raise ConflictError(f"key {key_id!r} is revoked")
            before = key_info(row)
            for field in ("name", "expires_at", "models", "requests_per_minute"):
                if (value := getattr(patch, field)) is not UNSET:
                    setattr(row, field, value)
            if patch.scopes is not UNSET:
                row.scopes = scopes_text(patch.scopes)
            after = key_info(row)
            add_entry(
                session,
                at=now,
                actor=actor,
                action="key.update",
                target=key_id,
                before=before,
                after=after,
            )
        self._cache.drop_key(key_id)
        return after

    async def rotate_key(
        self, key_id: str, rotate: KeyRotate, *, actor: str = "admin"
    ) -> tuple[KeyInfo, str, KeyInfo]:
        """Issue a successor with the same name, scopes, models and limit (its secret is shown
        this once); the old key works ``overlap_seconds`` more, or less if it expires sooner.

        Returns ``(new key, its secret, old key)``. A revoked, expired or already rotated key
        cannot be rotated (ConflictError).
        """
        now = self._clock()
        async with self._db.transaction() as session:
            row = await load_key(session, key_id, lock=True)
            if not is_live(row.revoked_at, row.expires_at, now) or row.replaced_by is not None:
                raise ConflictError(f"key {key_id!r} is revoked, expired or already rotated")
            await load_tenant(session, row.tenant_id)
            before = key_info(row)
            spec = KeySpec(
                name=row.name,
                expires_at=rotate.expires_at,
                scopes=before.scopes,
                models=row.models,
                requests_per_minute=row.requests_per_minute,
            )
            new, secret = await self._issue(session, row.tenant_id, spec, actor, now)
            overlap_end = now + timedelta(seconds=rotate.overlap_seconds)
            row.expires_at = min(overlap_end, row.expires_at or overlap_end)
            row.replaced_by = new.id
            old = key_info(row)
            add_entry(
                session,
                at=now,
                actor=actor,
                action="key.rotate",
                target=key_id,
                before=before,
                after=old,
            )
        self._cache.drop_key(key_id)
        return new, secret, old

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
            row = await load_key(session, key_id, lock=True)
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

        Raises InvalidKeyError (malformed, unknown, revoked, expired or rotated out) or
        TenantSuspendedError. Expiry is checked on every call, cached context or not.
        """
        prefix = parse_prefix(secret)
        key_hash = hash_key(self._secret, secret)
        if self._cache.refused(key_hash):
            raise InvalidKeyError("unknown or revoked API key")
        ctx = self._cache.get(key_hash)
        if ctx is None:
            ctx = await self._shared_lookup(key_hash, prefix, secret)
        if not is_live(None, ctx.expires_at, self._clock()):
            raise InvalidKeyError("API key expired")
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
        ctx = await self._lookup(key_hash, prefix, secret)
        self._cache.put(key_hash, ctx)
        return ctx

    def _lookup_done(self, key_hash: str, done: asyncio.Future[AuthContext]) -> None:
        if self._lookups.get(key_hash) is done:
            del self._lookups[key_hash]
        if not done.cancelled():
            done.exception()  # retrieved here too, in case every caller has given up

    async def refused_keys(self, key_ids: Collection[str]) -> dict[str, str]:
        """Of ``key_ids``, those that would be refused now: ``"revoked"`` (also for a key that
        no longer exists or has expired) or their tenant's status (``"suspended"``, ``"deleted"``).
        """
        now = self._clock()
        ids = sorted(set(key_ids))
        refused = {key_id: "revoked" for key_id in ids}
        async with self._db.sessions() as session:
            for start in range(0, len(ids), REFUSAL_CHUNK):
                rows = await session.execute(
                    select(ApiKey.id, ApiKey.revoked_at, ApiKey.expires_at, Tenant.status)
                    .join(Tenant, Tenant.id == ApiKey.tenant_id)
                    .where(ApiKey.id.in_(ids[start : start + REFUSAL_CHUNK]))
                )
                for key_id, revoked_at, expires_at, status in rows:
                    if status != "active":  # a deleted tenant's keys are revoked too: say why
                        refused[key_id] = status
                    elif is_live(revoked_at, expires_at, now):
                        del refused[key_id]
        return refused

    async def _lookup(self, key_hash: str, prefix: str, secret: str) -> AuthContext:
        now = self._clock()
        async with self._db.sessions() as session:
            found = (
                await session.execute(
                    select(ApiKey, Tenant)
                    .join(Tenant, Tenant.id == ApiKey.tenant_id)
                    .where(ApiKey.prefix == prefix)
                )
            ).one_or_none()
            # An unknown or revoked key never becomes valid (an expired one can, by a change
            # of its expiry): refused without a query for a few seconds.
            if found is None:
                self._cache.refuse(key_hash)
                raise InvalidKeyError("unknown API key")
            key, tenant = found
            if not key_matches(self._secret, secret, key.key_hash) or key.revoked_at is not None:
                self._cache.refuse(key_hash)
                raise InvalidKeyError("unknown or revoked API key")
            if not is_live(None, key.expires_at, now):
                raise InvalidKeyError("API key expired")
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
            return auth_context(key, tenant)
