"""The engine role's model-server routes: OpenAI completions and chat (SSE), models, probes.

Generation goes through the same ``GenerationPipeline`` as the tenant API; the tenant is
whoever the (token-holding) gateway names in the body (``EngineCaller``).
"""

from __future__ import annotations

from typing import Any

import msgspec
from litestar import Request, Response, get, post
from litestar.di import NamedDependency

from web.engine_api.caller import EngineCaller
from web.generation_pipeline import GenerationPipeline
from web.request_fields import CHAT, COMPLETION
from web.service_generation import GenerationService


class EngineModelCard(msgspec.Struct):
    id: str
    created: int
    max_model_len: int
    owned_by: str = "atrium"
    object: str = "model"
    # Tokens the KV cache holds (an Atrium extension; a gateway refuses longer prompts early).
    kv_capacity_tokens: int | None = None


class EngineModelList(msgspec.Struct):
    data: list[EngineModelCard]
    object: str = "list"


async def _generate(
    request: Request[Any, Any, Any], pipeline: GenerationPipeline, endpoint: str
) -> Response[Any]:
    with pipeline.arriving():
        admitted = await pipeline.admit(await request.body(), endpoint, EngineCaller())
    return await pipeline.respond(admitted)


@post("/v1/completions", status_code=200)
async def completions(
    request: Request[Any, Any, Any], pipeline: NamedDependency[GenerationPipeline]
) -> Response[Any]:
    return await _generate(request, pipeline, COMPLETION)


@post("/v1/chat/completions", status_code=200)
async def chat_completions(
    request: Request[Any, Any, Any], pipeline: NamedDependency[GenerationPipeline]
) -> Response[Any]:
    return await _generate(request, pipeline, CHAT)


@get("/v1/models")
async def list_models(generation: NamedDependency[GenerationService]) -> EngineModelList:
    runtime = generation.runtime
    card = EngineModelCard(
        id=runtime.name,
        created=0,
        max_model_len=runtime.max_model_len,
        kv_capacity_tokens=runtime.kv_capacity_tokens,
    )
    return EngineModelList([card])


ROUTES = [completions, chat_completions, list_models]
