"""The app factory: the app for each role, its routes, the one error mapping, the wiring of its
services (engines, tenant database, admin token, batch runner) and what lives on ``app.state``."""

from __future__ import annotations

import importlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager

import structlog
from litestar import Litestar, Router
from litestar.datastructures import State
from litestar.di import Provide
from litestar.types import ControllerRouterHandler
from opentelemetry.sdk.trace import SpanProcessor

from engine.heap import frozen_startup
from tenants.database import DEFAULT_POOL_SIZE
from tenants.server_secrets import ensure_admin_token
from web.admin.live_sampler import start_live_sampler
from web.engine_api import create_engine_app
from web.engine_api.gateway import follow_engines, remote_runtimes
from web.engine_api.local import EngineGroup, load_runtimes
from web.openai import routes as openai_routes
from web.openai.batch import routes as batch_routes
from web.openai.batch.runner import BatchRunner
from web.openai.generation import GenerationService, ModelRuntime
from web.openai.generation_routes import generation_dependencies
from web.openai.json_body import JsonRequest
from web.openai.openapi_bodies import describe as describe_openapi
from web.ops import health
from web.ops.errors import handle_exception
from web.ops.internal_port import internal_port_guard
from web.ops.metrics import GatewayMetrics
from web.ops.request_id import send_request_id
from web.ops.services import ops_dependencies
from web.ops.tracing import make_tracer_provider
from web.settings import Settings
from web.tenancy.auth_limiter import STATE_KEY as AUTH_LIMITER
from web.tenancy.auth_limiter import FailedAuthLimiter
from web.tenancy.prefix_delivery import start_prefix_delivery
from web.tenancy.prefix_feed import internal_router
from web.tenancy.principal import Tenancy
from web.tenancy.services import tenancy_dependencies
from web.tenancy.sql import SqlTenancy, connect_sql_tenancy

log = structlog.get_logger("atrium.web")
Closer = Callable[[], Awaitable[None]]


def _admin_routers() -> list[ControllerRouterHandler]:
    """The admin API's and the console's routers (optional parts of the gateway)."""
    routers: list[ControllerRouterHandler] = []
    for module_name, attribute in (
        ("web.admin", "admin_router"),
        ("web.console", "console_router"),
    ):
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        router = getattr(module, attribute, None)
        if isinstance(router, Router):
            routers.append(router)
    return routers


async def connect_tenancy(settings: Settings, state: State) -> tuple[Tenancy, Closer]:
    """The tenant database, the admin token (printed when first made) and the batch runner."""
    tenancy, lease, close_sql = await connect_sql_tenancy(settings, state)
    generated = await ensure_admin_token(state.db, settings.admin_token)
    if generated is not None:
        # Shown once: only its hash is stored.
        print(f"Admin token (shown once): {generated}", flush=True)
    runner = BatchRunner(state.batch_store, state, settings, lease, tenancy)
    runner.start()
    state.batch_runner = runner

    async def close() -> None:
        await runner.stop()
        await close_sql()

    return tenancy, close


def create_app(
    settings: Settings,
    engine: ModelRuntime | Sequence[ModelRuntime] | None = None,
    store: Tenancy | None = None,
    *,
    span_processor: SpanProcessor | None = None,
    include_admin: bool = True,
) -> Litestar:
    """The gateway app. Without ``engine`` (one served model, or several) the models are
    loaded at startup from ``settings``; without ``store`` the tenant database at
    ``settings.database_url`` is used."""
    admin = _admin_routers() if include_admin else []
    internal = settings.internal_port
    metrics = GatewayMetrics(per_tenant=settings.metrics_tenant_labels)
    provider = make_tracer_provider(settings.otlp_endpoint, span_processor)
    state = State(
        {
            "settings": settings,
            "metrics": metrics,
            "tracer_provider": provider,
            "generation": None,
            "tenancy": None,
            "engine": None,
            AUTH_LIMITER: FailedAuthLimiter(settings.auth_failures_per_minute),
        }
    )

    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        closers: list[Closer] = []
        try:
            if engine is None:
                runtimes, raw_engine, close_engine = await load_runtimes(settings)
                closers.append(close_engine)
                app.state.engine = raw_engine
            else:
                runtimes = [engine] if isinstance(engine, ModelRuntime) else list(engine)
                app.state.engine = (
                    runtimes[0].engine
                    if len(runtimes) == 1
                    else EngineGroup([r.engine for r in runtimes])
                )
            runtime = runtimes[0]
            tenancy = store
            if tenancy is None:
                tenancy, close_tenancy = await connect_tenancy(settings, app.state)
                closers.append(close_tenancy)
            service = GenerationService(
                runtimes,
                tenancy,
                metrics,
                provider.get_tracer("atrium.web"),
                default_max_tokens_cap=settings.default_max_tokens_cap,
                retry_after_s=settings.retry_after_s,
                max_stream_s=settings.max_stream_s,
                admission_concurrency=admission_concurrency(settings.database_url),
                trace_steps=bool(settings.otlp_endpoint) or span_processor is not None,
            )
            app.state.tenancy = tenancy
            app.state.generation = service
            if isinstance(tenancy, SqlTenancy):  # a crash bills the output delivered so far
                tenancy.start_checkpoints(service.delivered, settings.usage_checkpoint_s)
            domain = getattr(app.state, "tenant_domain", None)
            if domain is not None and (settings.role == "gateway" or settings.max_loras > 0):
                # Adapters load in this server's engine, or in the engines behind the router
                # (each from the registered folder, which must be there too).
                service.adapters = domain.lora_adapters
            delivery = await start_prefix_delivery(app.state, runtime)
            if delivery is not None:
                closers.append(delivery.stop)
            if admin:  # the console's live charts: the last hour, whether a console is open or not
                closers.append(await start_live_sampler(app.state))
            for served in runtimes:
                log.info("gateway_ready", model=served.name, max_model_len=served.max_model_len)
            with frozen_startup():  # full collections skip what start-up built
                yield
            runner = app.state.get("batch_runner")
            if runner is not None:  # its lines go back to pending, settled before the drain ends
                await runner.stop()
            await service.drain(settings.drain_grace_s)
            await tenancy.close()
        finally:
            for close in reversed(closers):
                await close()
            provider.shutdown()
            log.info("gateway_stopped")

    return Litestar(
        route_handlers=[
            *openai_routes.ROUTES,
            *batch_routes.ROUTES,
            *health.ROUTES,
            *admin,
            internal_router,
        ],
        exception_handlers={Exception: handle_exception},
        before_send=[send_request_id],
        dependencies=dependencies(),
        lifespan=[lifespan],
        on_startup=[describe_openapi],
        state=state,
        request_max_body_size=settings.max_body_bytes,
        request_class=JsonRequest,
        logging_config=None,
        middleware=[] if internal is None else [internal_port_guard(internal)],
    )


def dependencies() -> dict[str, Provide]:
    """The services routes take by name (``NamedDependency``) instead of reading ``app.state``."""
    return {
        **generation_dependencies(),
        **tenancy_dependencies(),
        **ops_dependencies(),
        "batch_api": Provide(batch_routes.provide_batch_api),
    }


def create_gateway_app(settings: Settings) -> Litestar:
    """The gateway app of all-in-one around remote engines (one router or engine per served
    model)."""
    remotes = remote_runtimes(settings)
    app = create_app(settings, engine=[runtime for runtime, _ in remotes])
    follow_engines(app, remotes)
    return app


def app_for_role(settings: Settings) -> Litestar:
    """The app `atrium serve` runs for ``settings.role``: all-in-one, engine or gateway."""
    if settings.role == "engine":
        return create_engine_app(settings)
    if settings.role == "gateway":
        return create_gateway_app(settings)
    return create_app(settings)


def admission_concurrency(database_url: str) -> int:
    """Admissions let through to the database at once: SQLite runs one transaction at a time
    (a single connection), PostgreSQL one per pooled connection."""
    return 1 if database_url.startswith("sqlite") else DEFAULT_POOL_SIZE
