"""The OpenAI-compatible tenant API: `/v1/models`, `/v1/chat/completions`, `/v1/completions`."""

from __future__ import annotations

from typing import Any

import structlog
from litestar import Request, get
from litestar.di import NamedDependency

from tenants.errors import InvalidKeyError
from web.openai import schemas, tokens, usage
from web.openai.generation import GenerationService
from web.openai.generation_routes import generation_routes
from web.openai.pipeline import KeyCaller
from web.ops.errors import ApiError
from web.tenancy.auth_limiter import client_address, limiter_of
from web.tenancy.principal import Principal, Tenancy

INFERENCE = "inference"  # the key scope that generation needs


async def _authenticate(request: Request[Any, Any, Any], scope: str | None = None) -> Principal:
    """The key's principal; a key without ``scope`` is refused with 401, as OpenAI refuses a
    restricted key that lacks a permission."""
    header = request.headers.get("authorization", "")
    scheme, _, secret = header.partition(" ")
    if scheme.lower() != "bearer" or not secret.strip():
        raise ApiError(
            401,
            "You didn't provide an API key: send `Authorization: Bearer <key>`.",
            code="invalid_api_key",
        )
    limiter = limiter_of(request)
    address = client_address(request)
    if limiter is not None:
        limiter.check(address)
    tenancy: Tenancy = request.app.state.tenancy
    try:
        principal = await tenancy.authenticate(secret.strip())
    except InvalidKeyError:
        if limiter is not None:
            limiter.record_failure(address)
        raise
    structlog.contextvars.bind_contextvars(tenant_id=principal.tenant_id)
    if scope is not None and scope not in principal.scopes:
        raise ApiError(401, f"This API key lacks the `{scope}` scope.", code="missing_scope")
    return principal


@get("/v1/models")
async def list_models(
    request: Request[Any, Any, Any], generation: NamedDependency[GenerationService]
) -> schemas.ModelList:
    principal = await _authenticate(request)
    runtime = generation.runtimes[0]  # adapters apply to the first served model
    cards = [
        schemas.ModelCard(id=r.name, created=0) for r in generation.visible_runtimes(principal)
    ]
    adapters = generation.adapters
    if adapters is not None:  # the tenant's own adapters and those shared with every tenant
        for adapter in await adapters.list_adapters(principal.tenant_id):
            if principal.allows_model(adapter.name):
                created = int(adapter.created_at.timestamp())
                cards.append(
                    schemas.ModelCard(id=adapter.name, created=created, parent=runtime.name)
                )
    return schemas.ModelList(cards)


async def _key_caller(request: Request[Any, Any, Any]) -> KeyCaller:
    return KeyCaller(await _authenticate(request, INFERENCE))


GENERATION = generation_routes(_key_caller, watch_disconnect=True, follow_trace=True)
ROUTES = [list_models, *GENERATION, *tokens.ROUTES, *usage.ROUTES]
