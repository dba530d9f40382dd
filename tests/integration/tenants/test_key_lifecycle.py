"""Key lifecycle: expiry, rotation with an overlap window, scopes and models, per-key limits."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import msgspec
import pytest

from tenants.errors import (
    ConflictError,
    InvalidInputError,
    InvalidKeyError,
    KeyNotFoundError,
    QuotaExceededError,
)
from tenants.key_policy import KeyPatch, KeyRotate, KeySpec
from tenants.schemas import Quotas, TenantCreate


async def _tenant(domain, **quotas):
    return await domain.tenants.create(TenantCreate(name="acme", quotas=Quotas(**quotas)))


def test_a_key_stops_at_its_expiry_even_when_cached(open_domain, clock) -> None:
    async def body() -> None:
        async with open_domain() as domain:
            tenant = await _tenant(domain)
            expires = clock.now + timedelta(minutes=5)
            info, secret = await domain.keys.create_key(
                tenant.id, KeySpec(name="ci", expires_at=expires)
            )
            assert info.expires_at == expires
            assert (await domain.keys.authenticate(secret)).expires_at == expires
            assert await domain.keys.refused_keys([info.id]) == {}
            clock.advance(299)
            await domain.keys.authenticate(secret)  # served from the cache, still valid
            clock.advance(1)
            with pytest.raises(InvalidKeyError, match="expired"):
                await domain.keys.authenticate(secret)
            assert await domain.keys.refused_keys([info.id]) == {info.id: "revoked"}
            # Extending the expiry brings the key back; clearing it makes it last.
            await domain.keys.update_key(info.id, KeyPatch(expires_at=None))
            assert (await domain.keys.authenticate(secret)).key_id == info.id

    asyncio.run(body())


def test_rotation_keeps_the_old_key_for_the_overlap_then_only_the_new(open_domain, clock) -> None:
    async def body() -> None:
        async with open_domain() as domain:
            tenant = await _tenant(domain)
            spec = KeySpec(name="ci", scopes=["inference"], models=["m1"], requests_per_minute=9)
            old, old_secret = await domain.keys.create_key(tenant.id, spec, actor="ops")
            new, new_secret, rotated = await domain.keys.rotate_key(
                old.id, KeyRotate(overlap_seconds=3600), actor="ops"
            )
            assert new_secret != old_secret and new.id != old.id
            assert (new.name, new.scopes, new.models, new.requests_per_minute) == (
                "ci",
                ["inference"],
                ["m1"],
                9,
            )
            assert rotated.replaced_by == new.id
            assert rotated.expires_at == clock.now + timedelta(hours=1)
            assert new.expires_at is None
            for secret in (old_secret, new_secret):
                ctx = await domain.keys.authenticate(secret)
                assert ctx.scopes == ("inference",) and ctx.models == ("m1",)
            with pytest.raises(ConflictError, match="rotated"):
                await domain.keys.rotate_key(old.id, KeyRotate())
            clock.advance(3600)
            with pytest.raises(InvalidKeyError):
                await domain.keys.authenticate(old_secret)
            assert (await domain.keys.authenticate(new_secret)).key_id == new.id
            audit = await domain.audit.entries(
                clock.now - timedelta(days=1), clock.now + timedelta(seconds=1)
            )
            actions = [(e.action, e.target, e.actor) for e in audit]
            assert actions[-2:] == [("key.create", new.id, "ops"), ("key.rotate", old.id, "ops")]
            assert audit[-1].before is not None and audit[-1].before["replaced_by"] is None
            assert audit[-1].after is not None and audit[-1].after["replaced_by"] == new.id

    asyncio.run(body())


def test_rotation_with_no_overlap_stops_the_old_key_at_once(open_domain, clock) -> None:
    async def body() -> None:
        async with open_domain() as domain:
            tenant = await _tenant(domain)
            old, old_secret = await domain.keys.create_key(tenant.id)
            await domain.keys.authenticate(old_secret)  # cached in this process
            _, new_secret, _ = await domain.keys.rotate_key(old.id, KeyRotate(overlap_seconds=0))
            with pytest.raises(InvalidKeyError):
                await domain.keys.authenticate(old_secret)
            await domain.keys.authenticate(new_secret)
            await domain.keys.revoke_key(old.id)
            with pytest.raises(KeyNotFoundError):
                await domain.keys.rotate_key("key_missing", KeyRotate())

    asyncio.run(body())


def test_update_changes_scopes_models_and_limit_and_is_audited(open_domain, clock) -> None:
    async def body() -> None:
        async with open_domain() as domain:
            tenant = await _tenant(domain)
            info, secret = await domain.keys.create_key(tenant.id)
            ctx = await domain.keys.authenticate(secret)
            assert ctx.scopes == ("inference", "usage:read") and ctx.models is None
            assert ctx.allows_model("anything")
            patched = await domain.keys.update_key(
                info.id,
                KeyPatch(scopes=["usage:read"], models=["m1", "m2"], requests_per_minute=4),
                actor="ops",
            )
            assert (patched.scopes, patched.models, patched.requests_per_minute) == (
                ["usage:read"],
                ["m1", "m2"],
                4,
            )
            ctx = await domain.keys.authenticate(secret)  # the cache entry was dropped
            assert ctx.scopes == ("usage:read",) and ctx.key_requests_per_minute == 4
            assert ctx.allows_model("m2") and not ctx.allows_model("m3")
            [entry] = [
                e
                for e in await domain.audit.entries(
                    clock.now - timedelta(days=1), clock.now + timedelta(seconds=1)
                )
                if e.action == "key.update"
            ]
            assert entry.before is not None and entry.before["models"] is None
            assert entry.after is not None and entry.after["models"] == ["m1", "m2"]
            await domain.keys.revoke_key(info.id)
            with pytest.raises(ConflictError):
                await domain.keys.update_key(info.id, KeyPatch(name="again"))

    asyncio.run(body())


def test_a_key_limit_applies_under_the_tenant_limit(open_domain, clock) -> None:
    async def body() -> None:
        async with open_domain() as domain:
            tenant = await _tenant(domain, requests_per_minute=4)
            _, limited = await domain.keys.create_key(tenant.id, KeySpec(requests_per_minute=2))
            _, free = await domain.keys.create_key(tenant.id, KeySpec(name="free"))
            limited_ctx = await domain.keys.authenticate(limited)
            free_ctx = await domain.keys.authenticate(free)
            first = await domain.admission.admit(limited_ctx, "a0", 1, 1)
            assert (first.limit_requests, first.remaining_requests) == (2, 1)  # the tighter one
            await domain.admission.admit(limited_ctx, "a1", 1, 1)
            with pytest.raises(QuotaExceededError) as refused:
                await domain.admission.admit(limited_ctx, "a2", 1, 1)
            err = refused.value
            assert (err.reason, err.limit_requests, err.remaining_requests) == (
                "key_requests_per_minute",
                2,
                0,
            )
            assert err.retry_after_s == pytest.approx(30.0)
            # The other key draws on what is left of the tenant's four requests.
            await domain.admission.admit(free_ctx, "b0", 1, 1)
            await domain.admission.admit(free_ctx, "b1", 1, 1)
            with pytest.raises(QuotaExceededError) as refused:
                await domain.admission.admit(free_ctx, "b2", 1, 1)
            assert refused.value.reason == "requests_per_minute"
            clock.advance(30)  # one key request refills; the tenant's bucket has two back
            await domain.admission.admit(limited_ctx, "a2", 1, 1)
            with pytest.raises(QuotaExceededError) as refused:
                await domain.admission.admit(limited_ctx, "a3", 1, 1)
            assert refused.value.reason == "key_requests_per_minute"

    asyncio.run(body())


def test_key_specs_refuse_bad_values() -> None:
    with pytest.raises(InvalidInputError):
        KeySpec(scopes=[])
    with pytest.raises(InvalidInputError):
        KeySpec(models=[])
    with pytest.raises(InvalidInputError):
        KeySpec(requests_per_minute=-1)
    with pytest.raises(InvalidInputError):
        KeyRotate(overlap_seconds=-5)
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"scopes": ["admin"]}, KeySpec)
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"expires_in": 5}, KeyPatch)
