"""A tenant's model allow-list: stored in its quotas, narrowed by each key's own list."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from tenants.errors import InvalidInputError
from tenants.key_policy import KeySpec
from tenants.schemas import Quotas, QuotasPatch, TenantCreate, TenantPatch


def test_tenant_models_narrow_every_key_and_reset_to_every_model(open_domain) -> None:
    async def body() -> None:
        async with open_domain() as domain:
            tenant = await domain.tenants.create(
                TenantCreate(name="acme", quotas=Quotas(models=("small",)))
            )
            assert tenant.quotas.models == ("small",)
            _, open_secret = await domain.keys.create_key(tenant.id, "open")
            _, big_secret = await domain.keys.create_key(
                tenant.id, KeySpec(name="big", models=["big", "small"])
            )
            assert (await domain.keys.authenticate(open_secret)).models == ("small",)
            assert (await domain.keys.authenticate(big_secret)).models == ("small",)
            patched = await domain.tenants.update(
                tenant.id, TenantPatch(quotas=QuotasPatch(models=("big", "small")))
            )
            assert patched.quotas.models == ("big", "small")
            assert (await domain.keys.authenticate(big_secret)).models == ("big", "small")
            await domain.tenants.update(tenant.id, TenantPatch(quotas=QuotasPatch(models=None)))
            assert (await domain.tenants.get(tenant.id)).quotas.models is None
            assert (await domain.keys.authenticate(open_secret)).models is None
            assert (await domain.keys.authenticate(big_secret)).models == ("big", "small")

    asyncio.run(body())


@pytest.mark.parametrize("models", [[], ["a", "a"], [""], ["x" * 101]])
def test_bad_model_lists_are_refused(models: list[str]) -> None:
    with pytest.raises((InvalidInputError, msgspec.ValidationError)):
        msgspec.convert({"models": models}, Quotas)
