"""Admin route on the live engine: its state per tenant."""

from __future__ import annotations

import inspect
from typing import Any

from litestar import get
from litestar.di import NamedDependency

from engine.stats import EngineSnapshot
from web.admin.context import AdminServices, engine
from web.admin.engine_state import (
    TokenRate,
    processed_tokens,
    to_engine_state,
    to_instance_state,
)
from web.admin.schemas import EngineState
from web.admin.tenants_controller import AdminRequest
from web.engine_api.fleet import EngineView
from web.ops.errors import ApiError


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


def _running_engine(request: AdminRequest) -> Any:
    found = engine(request)
    if found is None:
        raise ApiError(503, "No engine is running in this gateway.", code="engine_unavailable")
    return found


def _rate(rates: dict[str, TokenRate], key: str) -> TokenRate:
    """The token-rate sampler of one engine (``key``), kept on the app between polls."""
    rate = rates.get(key)
    if not isinstance(rate, TokenRate):
        rate = rates[key] = TokenRate()
    return rate


@get("/engine", tags=["admin"])
async def engine_status(
    request: AdminRequest,
    admin_services: NamedDependency[AdminServices],
    token_rates: NamedDependency[dict[str, TokenRate]],
) -> EngineState:
    """Every engine this gateway sends to: its own process, or those behind its engine URL
    (the router's worker list, polled now), each listed and all of them summed."""
    running = _running_engine(request)
    fleet = getattr(running, "fleet", None)
    views = await fleet.poll() if fleet is not None else None
    stats = getattr(running, "stats", None)
    snapshot = await _maybe_await(stats()) if callable(stats) else None
    if not isinstance(snapshot, EngineSnapshot):
        raise ApiError(501, "This engine does not report its state.", code="not_implemented")
    if views is None:
        views = [EngineView("local", bool(getattr(running, "is_running", True)), snapshot)]
    tenants = await admin_services.tenants.list_tenants(include_deleted=True)
    names = {t.id: t.name for t in tenants}
    engines = [
        to_instance_state(
            view.url,
            view.healthy,
            view.snapshot,
            _rate(token_rates, view.url).sample(processed_tokens(view.snapshot)),
            names,
        )
        for view in views
    ]
    state = to_engine_state(snapshot, names, 0.0)
    state.tokens_per_s = sum(e.tokens_per_s for e in engines)
    state.engines = engines
    return state
