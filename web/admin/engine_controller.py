"""Admin routes on the live engine: its state per tenant, and publishing a public prefix."""

from __future__ import annotations

import inspect
from typing import Any

from litestar import get, post
from litestar.params import JSONBody
from litestar.status_codes import HTTP_201_CREATED

from engine.stats import EngineSnapshot
from web.admin.context import engine, services
from web.admin.engine_state import TokenRate, processed_tokens, to_engine_state
from web.admin.schemas import EngineState, PublicPrefix, PublicPrefixCreate
from web.admin.tenants_controller import AdminRequest, actor_of
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


@post("/public-prefixes", status_code=HTTP_201_CREATED, tags=["admin"])
async def publish_prefix(request: AdminRequest, data: JSONBody[PublicPrefixCreate]) -> PublicPrefix:
    publish = getattr(_running_engine(request), "publish_prefix", None)
    if publish is None:
        raise ApiError(501, "This engine cannot publish public prefixes.", code="not_implemented")
    result = await _maybe_await(publish(data.text))
    published = PublicPrefix(
        num_tokens=int(getattr(result, "num_tokens", 0)),
        num_cached_tokens=int(getattr(result, "num_cached_tokens", 0)),
    )
    await (await services(request)).audit.record(
        actor=actor_of(request), action="public_prefix.publish", target="public", after=published
    )
    return published
