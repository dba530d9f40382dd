"""Where admin handlers find the app's shared objects: the database, the engine, the services.

Everything lives on ``app.state`` (set by ``web.app.create_app``); nothing here is a module global.
Admin handlers take what they need by dependency injection (``admin_dependencies``), never from
``app.state`` themselves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from litestar import Request
from litestar.connection import ASGIConnection
from litestar.datastructures import State
from litestar.di import Provide

from tenants.audit import AuditService
from tenants.auth_cache import AuthCache
from tenants.batch_store import BatchStore
from tenants.billing import BillingService
from tenants.database import Database
from tenants.domain import TenantDomain
from tenants.key_service import KeyService
from tenants.price_service import PriceService
from tenants.public_prefixes import PublicPrefixService
from tenants.server_secrets import load_key_secret
from tenants.spend import SpendReport
from tenants.tenant_service import TenantService
from tenants.usage_report import UsageReport
from web.admin.engine_state import TokenRate
from web.admin.live_metrics import LiveHistory
from web.ops.errors import ApiError
from web.ops.refusals import RefusalLog
from web.tenancy.prefix_delivery import PrefixDelivery, delivery_of

SERVICES_STATE = "admin_services"
HISTORY_STATE = "admin_live_history"
RATE_STATE = "admin_token_rate"


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
    spend: SpendReport


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
            spend=SpendReport(domain.db, domain.prices),
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
            spend=SpendReport(db, prices),
        )
    state[SERVICES_STATE] = built
    return built


async def provide_admin_services(request: Request[Any, Any, Any]) -> AdminServices:
    return await services(request)


async def provide_prefix_delivery(state: State) -> PrefixDelivery | None:
    """The gateway's public-prefix delivery to its engines (None where it has none)."""
    return delivery_of(state)


def live_history_of(state: State) -> LiveHistory:
    """The live charts' last hour of points, kept on the app (the sampler's and the polls')."""
    history = state.get(HISTORY_STATE)
    if not isinstance(history, LiveHistory):
        history = state[HISTORY_STATE] = LiveHistory()
    return history


async def provide_live_history(state: State) -> LiveHistory:
    return live_history_of(state)


def refusal_log_of(state: State) -> RefusalLog | None:
    """The refusals this gateway logged by tenant (None on an app that generates nothing)."""
    log = getattr(state.get("generation"), "refusals", None)
    return log if isinstance(log, RefusalLog) else None


async def provide_refusal_log(state: State) -> RefusalLog | None:
    return refusal_log_of(state)


def batch_store_of(state: State) -> BatchStore | None:
    """The Batch API's store (None without a tenant database), else one on ``state.db``."""
    store = state.get("batch_store")
    if isinstance(store, BatchStore):
        return store
    db = state.get("db")
    return BatchStore(db) if isinstance(db, Database) else None


async def provide_batch_store(state: State) -> BatchStore | None:
    return batch_store_of(state)


async def provide_token_rates(state: State) -> dict[str, TokenRate]:
    """Each engine's token-rate sampler (by its URL), kept on the app between polls."""
    rates = state.get(RATE_STATE)
    if not isinstance(rates, dict):
        rates = state[RATE_STATE] = {}
    return rates


async def provide_gateway_metrics(state: State) -> Any:
    """The gateway's metrics (None on an app without them)."""
    return state.get("metrics")


async def provide_served_models(state: State) -> Any:
    """The gateway's generation service, which knows the served models (None without one)."""
    return state.get("generation")


async def provide_server_role(state: State) -> str:
    """The role this server runs in (``all``, ``gateway`` or ``engine``)."""
    return str(getattr(state.get("settings"), "role", "all"))


def admin_dependencies() -> dict[str, Provide]:
    """What the admin handlers take by name (the admin router registers it)."""
    return {
        "admin_services": Provide(provide_admin_services),
        "prefix_delivery": Provide(provide_prefix_delivery),
        "live_history": Provide(provide_live_history),
        "refusal_log": Provide(provide_refusal_log),
        "batch_store": Provide(provide_batch_store),
        "token_rates": Provide(provide_token_rates),
        "gateway_metrics": Provide(provide_gateway_metrics),
        "served_models": Provide(provide_served_models),
        "server_role": Provide(provide_server_role),
    }
