"""Admin route on the live engine: its state per tenant."""

from __future__ import annotations

import inspect
from typing import Any

from litestar import get

from engine.stats import EngineSnapshot
from web.admin.context import engine, services
from web.admin.engine_state import TokenRate, processed_tokens, to_engine_state
from web.admin.schemas import EngineState
from web.admin.tenants_controller import AdminRequest
from web.errors import ApiError

RATE_STATE = "admin_token_rate"


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


def _running_engine(request: AdminRequest) -> Any:
    found = engine(request)
    if found is None:
        raise ApiError(503, "No engine is running in this gateway.", code="engine_unavailable")
    return found


@get("/engine", tags=["admin"])
async def engine_status(request: AdminRequest) -> EngineState:
    snapshot = await _maybe_await(_running_engine(request).stats())
    if not isinstance(snapshot, EngineSnapshot):
        raise ApiError(501, "This engine does not report its state.", code="not_implemented")
    state = request.app.state
    rate = state.get(RATE_STATE)
    if not isinstance(rate, TokenRate):
        rate = state[RATE_STATE] = TokenRate()
    tokens_per_s = rate.sample(processed_tokens(snapshot))
    tenants = await (await services(request)).tenants.list_tenants(include_deleted=True)
    return to_engine_state(snapshot, {t.id: t.name for t in tenants}, tokens_per_s)
