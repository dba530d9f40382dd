"""Server-sent events for streamed completions: one ``data:`` frame per delta, then ``[DONE]``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import msgspec

from engine.outputs import RequestOutput
from web.errors import ERROR_TYPES
from web.openai_schemas import (
    ChatChunkChoice,
    ChatCompletionChunk,
    Delta,
    TextChoice,
    TextCompletion,
    Usage,
)
from web.service_generation import GenerationService, Job

DONE = b"data: [DONE]\n\n"
MEDIA_TYPE = "text/event-stream"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def frame(payload: Any) -> bytes:
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"


def usage_of(job: Job) -> Usage:
    return Usage.of(job.prompt_tokens, job.cached_tokens, job.completion_tokens)


def error_frame(message: str) -> bytes:
    detail = {"message": message, "type": ERROR_TYPES[500], "param": None, "code": "engine_error"}
    return frame({"error": detail})


async def _outputs(
    first: RequestOutput, rest: AsyncIterator[RequestOutput]
) -> AsyncIterator[RequestOutput]:
    yield first
    if not first.finished:
        async for out in rest:
            yield out


async def chat_events(
    service: GenerationService,
    job: Job,
    *,
    model: str,
    first: RequestOutput,
    rest: AsyncIterator[RequestOutput],
    include_usage: bool,
) -> AsyncIterator[bytes]:
    """Chunks of ``chat.completion.chunk``: the role first, text deltas, the finish reason."""

    def chunk(delta: Delta, finish_reason: str | None = None) -> bytes:
        choice = ChatChunkChoice(index=0, delta=delta, finish_reason=finish_reason)
        return frame(ChatCompletionChunk(job.request_id, job.created, model, [choice]))

    yield chunk(Delta(role="assistant", content=""))
    async for out in _outputs(first, rest):
        if out.text:
            yield chunk(Delta(content=out.text))
        if out.finished:
            if out.finish_reason == "error":
                yield error_frame(out.error or "generation failed")
            else:
                yield chunk(Delta(), out.finish_reason)
    if include_usage:
        yield frame(ChatCompletionChunk(job.request_id, job.created, model, [], usage_of(job)))
    await service.wait_recorded(job)
    yield DONE


async def completion_events(
    service: GenerationService,
    job: Job,
    *,
    model: str,
    first: RequestOutput,
    rest: AsyncIterator[RequestOutput],
    include_usage: bool,
) -> AsyncIterator[bytes]:
    """Chunks of ``text_completion``: text deltas, then an empty one with the finish reason."""

    def chunk(text: str, finish_reason: str | None = None) -> bytes:
        choice = TextChoice(index=0, text=text, finish_reason=finish_reason)
        return frame(TextCompletion(job.request_id, job.created, model, [choice]))

    async for out in _outputs(first, rest):
        if out.text:
            yield chunk(out.text)
        if out.finished:
            if out.finish_reason == "error":
                yield error_frame(out.error or "generation failed")
            else:
                yield chunk("", out.finish_reason)
    if include_usage:
        yield frame(TextCompletion(job.request_id, job.created, model, [], usage_of(job)))
    await service.wait_recorded(job)
    yield DONE
