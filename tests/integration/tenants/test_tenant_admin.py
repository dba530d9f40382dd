"""Tenant CRUD, prices and the audit trail of every admin mutation."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest

from tenants.errors import ConflictError, KeyNotFoundError, TenantNotFoundError
from tenants.records import PriceSet
from tenants.schemas import Quotas, QuotasPatch, TenantCreate, TenantPatch


def test_crud_patches_quotas_partially_and_soft_deletes(open_domain) -> None:
    async def body() -> None:
        async with open_domain() as domain:
            quotas = Quotas(requests_per_minute=10, monthly_token_budget=1000)
            acme = await domain.tenants.create(TenantCreate(name="acme", quotas=quotas))
            await domain.tenants.create(TenantCreate(name="beta"))
            with pytest.raises(ConflictError):
                await domain.tenants.create(TenantCreate(name="acme"))
            patched = await domain.tenants.update(
                acme.id,
                TenantPatch(
                    weight=3.0, quotas=QuotasPatch(requests_per_minute=None, max_prompt_tokens=64)
                ),
            )
            assert patched.weight == 3.0
            assert patched.quotas == Quotas(monthly_token_budget=1000, max_prompt_tokens=64)
            assert await domain.tenants.get(acme.id) == patched
            await domain.tenants.delete(acme.id)
            with pytest.raises(TenantNotFoundError):
                await domain.tenants.get(acme.id)
            assert [t.name for t in await domain.tenants.list_tenants()] == ["beta"]
            everything = await domain.tenants.list_tenants(include_deleted=True)
            assert {t.name: t.status for t in everything} == {"acme": "deleted", "beta": "active"}
            with pytest.raises(KeyNotFoundError):
                await domain.keys.revoke_key("key_missing")

    asyncio.run(body())


def test_every_mutation_is_audited_oldest_first(open_domain, clock) -> None:
    async def body() -> None:
        async with open_domain() as domain:
            start = clock()
            tenant = await domain.tenants.create(TenantCreate(name="acme"), actor="alice")
            clock.advance(1)
            await domain.tenants.update(tenant.id, TenantPatch(weight=2.0), actor="bob")
            clock.advance(1)
            key, _ = await domain.keys.create_key(tenant.id, "ci", actor="bob")
            clock.advance(1)
            await domain.keys.revoke_key(key.id, actor="bob")
            clock.advance(1)
            await domain.prices.set_price(
                "m",
                PriceSet(input_per_million=1, cached_input_per_million=0, output_per_million=2),
                actor="carol",
            )
            clock.advance(1)
            await domain.tenants.delete(tenant.id, actor="alice")
            entries = await domain.audit.entries(start, clock() + timedelta(seconds=1))
            assert [(e.actor, e.action, e.target) for e in entries] == [
                ("alice", "tenant.create", tenant.id),
                ("bob", "tenant.update", tenant.id),
                ("bob", "key.create", key.id),
                ("bob", "key.revoke", key.id),
                ("carol", "price.set", "m"),
                ("alice", "tenant.delete", tenant.id),
            ]
            update = entries[1]
            assert update.before is not None and update.after is not None
            assert (update.before["weight"], update.after["weight"]) == (1.0, 2.0)
            assert entries[0].before is None and entries[0].after["name"] == "acme"
            assert entries[3].after is not None and entries[3].after["revoked_at"] is not None
            assert [e.at for e in entries] == sorted(e.at for e in entries)
            # A window that ends before the last mutation leaves it out.
            assert len(await domain.audit.entries(start, clock())) == 5

    asyncio.run(body())


def test_prices_keep_their_history(open_domain, clock) -> None:
    async def body() -> None:
        async with open_domain() as domain:
            later = clock() + timedelta(days=3)
            await domain.prices.set_price(
                "m",
                PriceSet(
                    input_per_million=100, cached_input_per_million=10, output_per_million=300
                ),
            )
            await domain.prices.set_price(
                "m",
                PriceSet(
                    input_per_million=200,
                    cached_input_per_million=20,
                    output_per_million=600,
                    currency="EUR",
                    effective_from=later,
                ),
            )
            prices = await domain.prices.list_prices()
            assert [(p.input_per_million, p.currency, p.effective_from) for p in prices] == [
                (100, "USD", clock()),
                (200, "EUR", later),
            ]

    asyncio.run(body())
