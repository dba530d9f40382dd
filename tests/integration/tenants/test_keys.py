"""API keys: issue, authenticate, revoke (effective on the next call), suspension, deletion."""

from __future__ import annotations

import asyncio

import pytest

from tenants.errors import InvalidKeyError, TenantSuspendedError
from tenants.schemas import Quotas, TenantCreate, TenantPatch


def test_key_authenticates_until_revoked(open_domain) -> None:
    async def body() -> None:
        async with open_domain() as domain:
            tenant = await domain.tenants.create(
                TenantCreate(name="acme", weight=2.5, quotas=Quotas(requests_per_minute=7))
            )
            info, secret = await domain.keys.create_key(tenant.id, "ci")
            assert secret.startswith(f"sk-atr-{info.prefix}-")
            ctx = await domain.keys.authenticate(secret)
            assert (ctx.tenant_id, ctx.tenant_name, ctx.key_id) == (tenant.id, "acme", info.id)
            assert ctx.weight == 2.5 and ctx.quotas.requests_per_minute == 7
            # The listing never carries the secret, and records the use.
            [listed] = await domain.keys.list_keys(tenant.id)
            assert secret not in repr(listed) and listed.last_used_at is not None
            await domain.keys.authenticate(secret)  # now served from the cache
            await domain.keys.revoke_key(info.id)
            with pytest.raises(InvalidKeyError):
                await domain.keys.authenticate(secret)

    asyncio.run(body())


def test_wrong_malformed_and_foreign_keys_are_rejected(open_domain) -> None:
    async def body() -> None:
        async with open_domain() as domain:
            tenant = await domain.tenants.create(TenantCreate(name="acme"))
            _, secret = await domain.keys.create_key(tenant.id)
            forged = secret[:-1] + ("a" if secret[-1] != "a" else "b")  # right prefix, bad hash
            other = f"sk-atr-{'z' * 10}-{'q' * 40}"
            for bad in (forged, other, "sk-atr-short", "", "Bearer " + secret):
                with pytest.raises(InvalidKeyError):
                    await domain.keys.authenticate(bad)

    asyncio.run(body())


def test_revocation_reaches_another_process_within_the_cache_ttl(open_domain, clock) -> None:
    async def body() -> None:
        async with open_domain() as gateway_a, open_domain() as gateway_b:
            tenant = await gateway_a.tenants.create(TenantCreate(name="acme"))
            info, secret = await gateway_a.keys.create_key(tenant.id)
            await gateway_b.keys.authenticate(secret)
            await gateway_a.keys.revoke_key(info.id)
            await asyncio.sleep(1.05)  # gateway_b's cache entry expires
            with pytest.raises(InvalidKeyError):
                await gateway_b.keys.authenticate(secret)

    asyncio.run(body())


def test_suspended_tenant_is_refused_and_deleted_tenant_loses_its_keys(open_domain) -> None:
    async def body() -> None:
        async with open_domain() as domain:
            tenant = await domain.tenants.create(TenantCreate(name="acme"))
            _, secret = await domain.keys.create_key(tenant.id)
            await domain.keys.authenticate(secret)
            await domain.tenants.update(tenant.id, TenantPatch(status="suspended"))
            with pytest.raises(TenantSuspendedError):
                await domain.keys.authenticate(secret)
            await domain.tenants.update(tenant.id, TenantPatch(status="active"))
            assert (await domain.keys.authenticate(secret)).status == "active"
            await domain.tenants.delete(tenant.id)
            with pytest.raises(InvalidKeyError):
                await domain.keys.authenticate(secret)

    asyncio.run(body())


def test_concurrent_requests_with_an_uncached_key_share_one_lookup(open_domain) -> None:
    """A burst of requests with a key not in the cache (its entries live at most a second)
    sends one database query, and every request gets its answer: the context, or the error."""

    async def body() -> None:
        async with open_domain() as domain:
            tenant = await domain.tenants.create(TenantCreate(name="acme"))
            info, secret = await domain.keys.create_key(tenant.id)
            keys = domain.keys
            lookup = keys._lookup
            calls: list[str] = []

            async def counted(key_hash: str, prefix: str, key: str) -> object:
                calls.append(prefix)
                await asyncio.sleep(0.05)  # the others arrive while it runs
                return await lookup(key_hash, prefix, key)

            keys._lookup = counted  # type: ignore[method-assign]
            ctxs = await asyncio.gather(*(keys.authenticate(secret) for _ in range(12)))
            assert len(calls) == 1
            assert {(c.tenant_id, c.key_id) for c in ctxs} == {(tenant.id, info.id)}
            # One caller giving up does not cancel the lookup the others wait on.
            keys._cache.drop_key(info.id)
            leaver = asyncio.ensure_future(keys.authenticate(secret))
            stayer = asyncio.ensure_future(keys.authenticate(secret))
            await asyncio.sleep(0.01)
            leaver.cancel()
            assert (await stayer).key_id == info.id and len(calls) == 2
            # An unknown key: every caller gets the error, from one lookup.
            forged = secret[:-1] + ("a" if secret[-1] != "a" else "b")
            results = await asyncio.gather(
                *(keys.authenticate(forged) for _ in range(5)), return_exceptions=True
            )
            assert all(isinstance(r, InvalidKeyError) for r in results) and len(calls) == 3

    asyncio.run(body())


def test_refused_keys_cost_one_query_until_the_refusal_expires(open_domain) -> None:
    """Made-up keys are remembered as refused for a few seconds (bounded), so repeating one
    costs no query; a revoked key is refused at once; a valid key is never held up."""

    async def body() -> None:
        async with open_domain() as domain:
            tenant = await domain.tenants.create(TenantCreate(name="acme"))
            info, secret = await domain.keys.create_key(tenant.id)
            keys = domain.keys
            now = [0.0]
            keys._cache._monotonic = lambda: now[0]  # type: ignore[attr-defined]
            lookup = keys._lookup
            calls: list[str] = []

            async def counted(key_hash: str, prefix: str, key: str) -> object:
                calls.append(prefix)
                return await lookup(key_hash, prefix, key)

            keys._lookup = counted  # type: ignore[method-assign]
            made_up = f"sk-atr-{'z' * 10}-{'q' * 40}"
            forged = secret[:-1] + ("a" if secret[-1] != "a" else "b")
            for bad in [made_up, forged] * 10:
                with pytest.raises(InvalidKeyError):
                    await keys.authenticate(bad)
            assert len(calls) == 2
            now[0] += 5.1  # the refusal expires: the next try queries again
            with pytest.raises(InvalidKeyError):
                await keys.authenticate(made_up)
            assert len(calls) == 3
            assert (await keys.authenticate(secret)).key_id == info.id
            await keys.revoke_key(info.id)
            for _ in range(3):
                with pytest.raises(InvalidKeyError):
                    await keys.authenticate(secret)
            assert len(calls) == 5

    asyncio.run(body())
