"""The engine role's model-server routes: OpenAI completions and chat (SSE), models, probes.

Generation goes through the same ``GenerationPipeline`` as the tenant API; the tenant is
whoever the (token-holding) gateway names in the body (``EngineCaller``).
"""

from __future__ import annotations

from typing import Any

import msgspec
from litestar import Request, get
from litestar.di import NamedDependency

from web.engine_api.caller import EngineCaller
from web.openai.generation import GenerationService
from web.openai.generation_routes import generation_routes


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


async def _engine_caller(request: Request[Any, Any, Any], _: GenerationService) -> EngineCaller:
    return EngineCaller()  # the token guard has checked the caller; the body names the tenant


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


# The gateway in front watches its own client and carries the trace.
GENERATION = generation_routes(_engine_caller, watch_disconnect=False, follow_trace=False)
ROUTES = [*GENERATION, list_models]
