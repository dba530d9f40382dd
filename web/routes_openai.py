"""The OpenAI-compatible tenant API: `/v1/models`, `/v1/chat/completions`, `/v1/completions`."""

from __future__ import annotations

from typing import Any

import structlog
from litestar import Request, Response, get, post
from litestar.di import NamedDependency

from tenants.errors import InvalidKeyError
from web import openai_schemas as schemas
from web import routes_tokens, routes_usage
from web.auth_limiter import client_address, limiter_of
from web.errors import ApiError
from web.generation_pipeline import GenerationPipeline, KeyCaller
from web.request_fields import CHAT, COMPLETION
from web.service_generation import GenerationService
from web.tenancy import Principal, Tenancy
from web.tracing import incoming_context

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


@post("/v1/chat/completions", status_code=200)
async def chat_completions(
    request: Request[Any, Any, Any], pipeline: NamedDependency[GenerationPipeline]
) -> Response[Any]:
    return await _generate(request, pipeline, CHAT)


@post("/v1/completions", status_code=200)
async def completions(
    request: Request[Any, Any, Any], pipeline: NamedDependency[GenerationPipeline]
) -> Response[Any]:
    return await _generate(request, pipeline, COMPLETION)


async def _generate(
    request: Request[Any, Any, Any], pipeline: GenerationPipeline, endpoint: str
) -> Response[Any]:
    with pipeline.arriving():
        caller = KeyCaller(await _authenticate(request, INFERENCE))
        trace_parent = incoming_context(request.headers)
        raw = await request.body()
        admitted = await pipeline.admit(raw, endpoint, caller, trace_parent=trace_parent)
    return await pipeline.respond(admitted, request)


ROUTES = [list_models, chat_completions, completions, *routes_tokens.ROUTES, *routes_usage.ROUTES]
