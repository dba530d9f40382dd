"""The gateway's tenancy through a database outage: which keys still work, and for how long."""

from __future__ import annotations

import asyncio
from collections.abc import Collection

import pytest

from tenants.errors import InvalidKeyError, TenantSuspendedError
from tenants.schemas import AuthContext, Quotas
from web.ops.errors import ApiError
from web.tenancy.auth_fallback import KnownKeys
from web.tenancy.sql import SqlTenancy


class Keys:
    """The key service as the database would answer while it is up."""

    def __init__(self) -> None:
        self.contexts = {
            f"sk-{k}": AuthContext(
                tenant_id=f"tn_{k}",
                tenant_name=k,
                key_id=f"key_{k}",
                weight=1.0,
                status="active",
                quotas=Quotas(),
            )
            for k in ("a", "b", "c")
        }
        self.refusals: dict[str, str] = {}

    async def authenticate(self, secret: str) -> AuthContext:
        ctx = self.contexts[secret]
        if self.refusals.get(ctx.key_id) == "revoked":
            raise InvalidKeyError("revoked")
        if ctx.key_id in self.refusals:
            raise TenantSuspendedError("suspended")
        return ctx

    async def refused_keys(self, key_ids: Collection[str]) -> dict[str, str]:
        return {k: r for k, r in self.refusals.items() if k in key_ids}


class Db:
    async def probe(self, timeout_s: float | None = None) -> bool:
        return False


class Meter:
    healthy = True

    async def flush(self) -> None:
        pass


class Clock:
    t = 100.0

    def __call__(self) -> float:
        return self.t


def tenancy() -> tuple[SqlTenancy, Keys, Clock, list[str]]:
    keys, clock, dropped = Keys(), Clock(), []
    t = SqlTenancy(
        keys,  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]
        Meter(),  # type: ignore[arg-type]
        Db(),  # type: ignore[arg-type]
        known_keys=KnownKeys(max_age_s=60.0, monotonic=clock),
    )
    t.on_tenant_gone.append(dropped.append)
    return t, keys, clock, dropped


async def verify_all_then_outage(t: SqlTenancy) -> None:
    for secret in ("sk-a", "sk-b", "sk-c"):
        await t.authenticate(secret)
    t.monitor.report(ConnectionRefusedError())
    assert t.monitor.down


def test_a_key_revoked_through_this_gateway_is_refused_at_once_in_an_outage() -> None:
    async def body() -> None:
        t, _, _, _ = tenancy()
        for secret in ("sk-a", "sk-b"):
            await t.authenticate(secret)
        t.key_revoked("key_a")  # the admin API revoked it; the sweep has not run
        t.monitor.report(ConnectionRefusedError())
        with pytest.raises(InvalidKeyError):
            await t.authenticate("sk-a")
        assert (await t.authenticate("sk-b")).tenant_id == "tn_b"

    asyncio.run(body())


def test_the_sweep_learns_refusals_made_elsewhere_and_drops_gone_tenants() -> None:
    async def body() -> None:
        t, keys, _, dropped = tenancy()
        for secret in ("sk-a", "sk-b", "sk-c"):
            await t.authenticate(secret)
        keys.refusals = {"key_a": "revoked", "key_b": "suspended"}  # by another process
        await t._sweep_refusals()
        assert dropped == ["tn_b"]  # its cached pages go; a revoked key's tenant stays
        t.monitor.report(ConnectionRefusedError())
        with pytest.raises(InvalidKeyError):
            await t.authenticate("sk-a")
        with pytest.raises(TenantSuspendedError):
            await t.authenticate("sk-b")
        assert (await t.authenticate("sk-c")).tenant_id == "tn_c"

    asyncio.run(body())


def test_a_suspension_here_refuses_the_tenants_keys_and_drops_its_cache() -> None:
    async def body() -> None:
        t, _, _, dropped = tenancy()
        await verify_all_then_outage(t)
        t.tenant_gone("tn_c", "suspended")
        assert dropped == ["tn_c"]
        with pytest.raises(TenantSuspendedError):
            await t.authenticate("sk-c")

    asyncio.run(body())


def test_keys_serve_through_an_outage_for_max_age_since_the_last_sweep_then_503() -> None:
    async def body() -> None:
        t, keys, clock, _ = tenancy()
        for secret in ("sk-a", "sk-b"):
            await t.authenticate(secret)
        clock.t += 55.0
        await t._sweep_refusals()  # both still valid: their age restarts
        keys.refusals = {"key_a": "revoked"}  # elsewhere, just before the outage
        t.monitor.report(ConnectionRefusedError())
        clock.t += 30.0
        assert (await t.authenticate("sk-a")).key_id == "key_a"  # unknowable here
        clock.t += 31.0
        for secret in ("sk-a", "sk-b"):
            with pytest.raises(ApiError) as refused:
                await t.authenticate(secret)
            assert (refused.value.status_code, refused.value.code) == (
                503,
                "database_unavailable",
            )

    asyncio.run(body())


def test_a_key_never_verified_before_the_outage_is_503_not_401() -> None:
    async def body() -> None:
        t, _, _, _ = tenancy()
        await t.authenticate("sk-a")
        t.monitor.report(ConnectionRefusedError())
        with pytest.raises(ApiError) as refused:
            await t.authenticate("sk-b")
        assert refused.value.status_code == 503 and refused.value.headers["Retry-After"]
        assert t.metrics.unverified_keys._value.get() == 1

    asyncio.run(body())
