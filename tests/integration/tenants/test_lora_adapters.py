"""LoRA adapters in SQL: register for one tenant or all, who may use which, removal, audit."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest

from tenants.errors import ConflictError, InvalidInputError, NotFoundError, TenantNotFoundError
from tenants.lora_adapters import LoraAdapterService
from tenants.schemas import TenantCreate
from tests.integration.tenants.conftest import FakeClock, OpenDomain


def test_a_tenant_uses_its_own_and_shared_adapters_only(
    open_domain: OpenDomain, clock: FakeClock
) -> None:
    async def body() -> None:
        async with open_domain() as domain:
            service: LoraAdapterService = domain.lora_adapters
            acme = await domain.tenants.create(TenantCreate(name="acme"))
            globex = await domain.tenants.create(TenantCreate(name="globex"))
            mine = await service.register("acme-support", "/srv/a", acme.id, actor="alice")
            shared = await service.register("summarize", "/srv/s", None)
            theirs = await service.register("globex-legal", "/srv/g", globex.id)
            assert mine.id.startswith("la_") and mine.created_by == "alice"
            assert [a.name for a in await service.list_adapters()] == [
                "acme-support",
                "globex-legal",
                "summarize",
            ]
            usable = await service.list_adapters(acme.id)
            assert [a.name for a in usable] == ["acme-support", "summarize"]
            assert await service.usable(acme.id, "acme-support") == mine
            assert await service.usable(acme.id, "summarize") == shared
            assert await service.usable(acme.id, "globex-legal") is None
            assert await service.usable(globex.id, "globex-legal") == theirs
            assert await service.usable(acme.id, "x" * 500) is None
            with pytest.raises(ConflictError):
                await service.register("summarize", "/srv/other", acme.id)
            with pytest.raises(TenantNotFoundError):
                await service.register("ghost", "/srv/x", "tn_missing")
            for bad_name in ("", "has space", "x" * 129, "nul\x00"):
                with pytest.raises(InvalidInputError):
                    await service.register(bad_name, "/srv/x", None)
            with pytest.raises(InvalidInputError):
                await service.register("empty-path", " ", None)

            removed = await service.remove(mine.id, actor="bob")
            assert removed == mine
            assert await service.usable(acme.id, "acme-support") is None
            with pytest.raises(NotFoundError):
                await service.remove(mine.id)
            window = (clock() - timedelta(hours=1), clock() + timedelta(hours=1))
            actions = [e.action for e in await domain.audit.entries(*window)]
            assert actions.count("lora_adapter.register") == 3
            assert actions.count("lora_adapter.remove") == 1

    asyncio.run(body())


def test_an_adapter_names_its_base_model(open_domain: OpenDomain, clock: FakeClock) -> None:
    async def body() -> None:
        async with open_domain() as domain:
            service: LoraAdapterService = domain.lora_adapters
            acme = await domain.tenants.create(TenantCreate(name="acme"))
            big = await service.register("big-tone", "/srv/b", acme.id, base_model="org/big-7b")
            first = await service.register("plain", "/srv/p", None)
            assert (big.base_model, first.base_model) == ("org/big-7b", None)
            assert await service.usable(acme.id, "big-tone") == big
            assert [a.base_model for a in await service.list_adapters()] == ["org/big-7b", None]
            for bad in ("", "x" * 129, "big\x00", "line\nbreak"):
                with pytest.raises(InvalidInputError) as refused:
                    await service.register("x", "/srv/x", None, base_model=bad)
                assert refused.value.param == "base_model"
            window = (clock() - timedelta(hours=1), clock() + timedelta(hours=1))
            (entry, _) = [
                e for e in await domain.audit.entries(*window) if e.action.startswith("lora")
            ]
            assert entry.after is not None and entry.after["base_model"] == "org/big-7b"

    asyncio.run(body())
