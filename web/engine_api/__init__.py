"""The engine role (`atrium serve --role engine`): the engine behind the model-server protocol.

Gateways (directly or through a router) call it with the engine token; it has no database,
never sees an API key, and learns each request's tenant from the body (``wire``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import structlog
from litestar import Litestar, Router
from litestar.connection import ASGIConnection
from litestar.datastructures import State
from litestar.handlers.base import BaseRouteHandler

from engine.heap import frozen_startup
from engine.stats import EngineSnapshot
from web.engine_api import ops, routes
from web.engine_api.local import load_runtime
from web.engine_api.metrics import ModelServerCollector
from web.engine_api.trusted import TrustedTenancy
from web.engine_api.wire import check_token
from web.openai.generation import GenerationService, ModelRuntime
from web.openai.generation_routes import generation_dependencies
from web.openai.json_body import JsonRequest
from web.ops.errors import handle_exception
from web.ops.metrics import GatewayMetrics
from web.ops.request_id import send_request_id
from web.ops.services import ops_dependencies
from web.ops.tracing import make_tracer_provider
from web.settings import Settings
from web.tenancy.prefix_feed import start_following

log = structlog.get_logger("atrium.engine_api")
# Requests handed to the engine at once: admission here is only a hand-off (no database).
ADMISSION_CONCURRENCY = 256


def create_engine_app(settings: Settings, runtime: ModelRuntime | None = None) -> Litestar:
    """The engine role's app. Without ``runtime`` the model is loaded at startup from
    ``settings`` (in an engine process, as in all-in-one)."""
    if not settings.engine_token:
        raise ValueError("the engine role needs an engine token")
    metrics = GatewayMetrics(per_tenant=settings.metrics_tenant_labels)
    provider = make_tracer_provider(settings.otlp_endpoint, None)
    state = State({"settings": settings, "metrics": metrics, "generation": None, "engine": None})

    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        close = None
        following: asyncio.Task[None] | None = None
        try:
            loaded = runtime
            if loaded is None:
                loaded, raw_engine, close = await load_runtime(settings)
            else:
                raw_engine = loaded.engine
            app.state.engine = raw_engine

            def snapshot() -> EngineSnapshot:
                found = raw_engine.stats()
                return found if isinstance(found, EngineSnapshot) else EngineSnapshot()

            metrics.registry.register(ModelServerCollector(snapshot, loaded.name))
            service = GenerationService(
                loaded,
                TrustedTenancy(),
                metrics,
                provider.get_tracer("atrium.engine"),
                default_max_tokens_cap=settings.default_max_tokens_cap,
                retry_after_s=settings.retry_after_s,
                max_stream_s=settings.max_stream_s,
                admission_concurrency=ADMISSION_CONCURRENCY,
            )
            app.state.generation = service
            following = start_following(raw_engine, settings.gateway_url, settings.engine_token)
            log.info("engine_ready", model=loaded.name, max_model_len=loaded.max_model_len)
            with frozen_startup():  # full collections skip what start-up built
                yield
            await service.drain(settings.drain_grace_s)
        finally:
            if following is not None:
                following.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await following
            if close is not None:
                await close()
            provider.shutdown()
            log.info("engine_server_stopped")

    def token_guard(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
        check_token(connection.headers.get("authorization", ""), settings.engine_token or "")

    guarded = Router(path="/", route_handlers=[*routes.ROUTES, *ops.ROUTES], guards=[token_guard])
    return Litestar(
        route_handlers=[guarded, *ops.OPEN_ROUTES],
        exception_handlers={Exception: handle_exception},
        before_send=[send_request_id],
        dependencies={**generation_dependencies(), **ops_dependencies()},
        lifespan=[lifespan],
        state=state,
        request_max_body_size=settings.max_body_bytes,
        request_class=JsonRequest,
        logging_config=None,
    )
