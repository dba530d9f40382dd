"""The generation routes (`/v1/chat/completions`, `/v1/completions`) for a kind of caller, and
the services they take by Litestar's dependency injection."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import structlog
from litestar import Request, Response, post
from litestar.di import NamedDependency, Provide
from litestar.handlers import HTTPRouteHandler

from web.openai.fields import CHAT, COMPLETION
from web.openai.generation import GenerationService, provide_generation
from web.openai.pipeline import Caller, GenerationPipeline, new_request_id
from web.ops.errors import CLIENT_CLOSED, refusal_reason, to_api_error
from web.ops.request_id import request_id_of
from web.ops.request_log import RequestTrail
from web.ops.tracing import incoming_context

CallerOf = Callable[[Request[Any, Any, Any], GenerationService], Awaitable[Caller]]


def generation_routes(
    caller_of: CallerOf, *, watch_disconnect: bool, follow_trace: bool
) -> list[HTTPRouteHandler]:
    """Chat and text completions for the callers ``caller_of`` makes of a request (it may
    refuse one); ``watch_disconnect`` aborts the engine request of a client gone before its
    answer, ``follow_trace`` continues the trace the request's headers name."""

    async def serve(
        request: Request[Any, Any, Any], pipeline: GenerationPipeline, endpoint: str
    ) -> Response[Any]:
        # The completion's id names the request too, unless the client named it itself.
        completion_id = new_request_id(endpoint)
        ids = request_id_of(request.scope)
        ids.name(completion_id)
        structlog.contextvars.bind_contextvars(request_id=ids.value)
        trail = RequestTrail(ids.value, endpoint)
        try:
            with pipeline.arriving():
                caller = await caller_of(request, pipeline.service)
                parent = incoming_context(request.headers) if follow_trace else None
                raw = await request.body()
                admitted = await pipeline.admit(
                    raw, endpoint, caller, request_id=completion_id, trace_parent=parent,
                    trail=trail,
                )  # fmt: skip
        except asyncio.CancelledError:  # the client left while the request was being admitted
            trail.refused(CLIENT_CLOSED, "client_closed")
            raise
        except Exception as exc:
            error = to_api_error(exc)
            trail.refused(error.status_code, refusal_reason(exc, error))
            raise
        # From here the request has a job, whose end writes its line (web/openai/generation.py).
        return await pipeline.respond(admitted, request if watch_disconnect else None)

    @post("/v1/chat/completions", status_code=200)
    async def chat_completions(
        request: Request[Any, Any, Any], pipeline: NamedDependency[GenerationPipeline]
    ) -> Response[Any]:
        return await serve(request, pipeline, CHAT)

    @post("/v1/completions", status_code=200)
    async def completions(
        request: Request[Any, Any, Any], pipeline: NamedDependency[GenerationPipeline]
    ) -> Response[Any]:
        return await serve(request, pipeline, COMPLETION)

    return [chat_completions, completions]


async def provide_pipeline(generation: NamedDependency[GenerationService]) -> GenerationPipeline:
    """The pipeline over the app's generation service (dependency ``pipeline``)."""
    return GenerationPipeline(generation)


def generation_dependencies() -> dict[str, Provide]:
    """What the generation routes take by name: the service and the pipeline over it."""
    return {"generation": Provide(provide_generation), "pipeline": Provide(provide_pipeline)}
