"""Where admin handlers find the app's shared objects: the database, the engine, the services.

Everything lives on ``app.state`` (set by ``web.app.create_app``); nothing here is a module global.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from litestar.connection import ASGIConnection
from litestar.datastructures import State

from tenants.audit import AuditService
from tenants.auth_cache import AuthCache
from tenants.billing import BillingService
from tenants.database import Database
from tenants.domain import TenantDomain
from tenants.key_service import KeyService
from tenants.price_service import PriceService
from tenants.public_prefixes import PublicPrefixService
from tenants.server_secrets import load_key_secret
from tenants.tenant_service import TenantService
from tenants.usage_report import UsageReport
from web.ops.errors import ApiError

SERVICES_STATE = "admin_services"


@dataclass(frozen=True, slots=True)
class AdminServices:
    """The tenant-domain services the admin API and the console call."""

    tenants: TenantService
    keys: KeyService
    audit: AuditService
    prices: PriceService
    reports: UsageReport
    billing: BillingService
    public_prefixes: PublicPrefixService


def app_state(connection: ASGIConnection[Any, Any, Any, Any]) -> State:
    return connection.app.state


def database(connection: ASGIConnection[Any, Any, Any, Any]) -> Database:
    state = app_state(connection)
    db = state.get("db")
    if not isinstance(db, Database):
        domain = next((v for v in state.values() if isinstance(v, TenantDomain)), None)
        db = domain.db if domain is not None else None
    if db is None:
        raise ApiError(503, "The database is not configured.", code="database_unavailable")
    return db


def engine(connection: ASGIConnection[Any, Any, Any, Any]) -> Any | None:
    """The app's ``AsyncEngine`` (or None when the gateway runs without one)."""
    return app_state(connection).get("engine")


async def services(connection: ASGIConnection[Any, Any, Any, Any]) -> AdminServices:
    """The gateway's tenant services when it holds a `TenantDomain` (its key service owns the auth
    cache, so a revocation drops cached keys at once), else services built on ``state.db``."""
    state = app_state(connection)
    cached = state.get(SERVICES_STATE)
    if isinstance(cached, AdminServices):
        return cached
    domain = next((v for v in state.values() if isinstance(v, TenantDomain)), None)
    if domain is not None:
        built = AdminServices(
            tenants=domain.tenants,
            keys=domain.keys,
            audit=domain.audit,
            prices=domain.prices,
            reports=domain.reports,
            billing=domain.billing,
            public_prefixes=domain.public_prefixes,
        )
    else:
        db = database(connection)
        prices = PriceService(db)
        built = AdminServices(
            tenants=TenantService(db),
            keys=KeyService(db, await load_key_secret(db), AuthCache()),
            audit=AuditService(db),
            prices=prices,
            reports=UsageReport(db),
            billing=BillingService(db, prices),
            public_prefixes=PublicPrefixService(db),
        )
    state[SERVICES_STATE] = built
    return built
