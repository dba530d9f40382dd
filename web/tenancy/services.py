"""The tenant side's services as Litestar dependencies: the tenancy and the tenant database's
domain (None on a server without a database)."""

from __future__ import annotations

from litestar.datastructures import State
from litestar.di import NamedDependency, Provide
from litestar.params import SkipValidation

from tenants.domain import TenantDomain
from web.tenancy.principal import Tenancy

# A route's ``tenancy`` parameter: a protocol, which the signature model cannot check.
TenancyDependency = NamedDependency[SkipValidation[Tenancy]]


async def provide_tenancy(state: State) -> Tenancy:
    tenancy: Tenancy = state.tenancy
    return tenancy


async def provide_tenant_domain(state: State) -> TenantDomain | None:
    domain: TenantDomain | None = state.get("tenant_domain")
    return domain


def tenancy_dependencies() -> dict[str, Provide]:
    return {
        "tenancy": Provide(provide_tenancy),
        "tenant_domain": Provide(provide_tenant_domain),
    }
