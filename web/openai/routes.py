"""The OpenAI-compatible tenant API: `/v1/models`, `/v1/chat/completions`, `/v1/completions`."""

from __future__ import annotations

from typing import Any

from litestar import Request, get
from litestar.di import NamedDependency

from web.openai import schemas, tokens, usage
from web.openai.generation import GenerationService
from web.openai.generation_routes import generation_routes
from web.openai.pipeline import KeyCaller
from web.tenancy.auth import INFERENCE, authenticate


@get("/v1/models")
async def list_models(
    request: Request[Any, Any, Any], generation: NamedDependency[GenerationService]
) -> schemas.ModelList:
    principal = await authenticate(request, generation.tenancy)
    cards = [
        schemas.ModelCard(id=r.name, created=0) for r in generation.visible_runtimes(principal)
    ]
    adapters = generation.adapters
    if adapters is not None:  # the tenant's own adapters and those shared with every tenant
        for adapter in await adapters.list_adapters(principal.tenant_id):
            base = generation.base_runtime(adapter)  # None: its base model is served elsewhere
            if base is not None and principal.allows_model(adapter.name):
                created = int(adapter.created_at.timestamp())
                cards.append(schemas.ModelCard(id=adapter.name, created=created, parent=base.name))
    return schemas.ModelList(cards)


async def _key_caller(request: Request[Any, Any, Any], service: GenerationService) -> KeyCaller:
    return KeyCaller(await authenticate(request, service.tenancy, INFERENCE))


GENERATION = generation_routes(_key_caller, watch_disconnect=True, follow_trace=True)
ROUTES = [list_models, *GENERATION, *tokens.ROUTES, *usage.ROUTES]
