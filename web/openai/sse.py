"""Server-sent events for streamed completions: one ``data:`` frame per delta, then ``[DONE]``."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import Any

import msgspec

from engine.outputs import RequestOutput, TokenLogprob
from web.openai.chat import ChatStreamTools
from web.openai.generation import GenerationService, Job
from web.openai.logprobs import TokenNames, chat_logprobs, completion_logprobs
from web.openai.schemas import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatLogprobs,
    CompletionLogprobs,
    Delta,
    TextChoice,
    TextCompletion,
    Usage,
)
from web.ops.errors import ERROR_TYPES

DONE = b"data: [DONE]\n\n"
MEDIA_TYPE = "text/event-stream"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def frame(payload: Any) -> bytes:
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"


def usage_of(job: Job) -> Usage:
    return Usage.of(job.prompt_tokens, job.cached_tokens, job.completion_tokens)


def error_frame(message: str, extra: Mapping[str, object] | None = None) -> bytes:
    detail = {"message": message, "type": ERROR_TYPES[500], "param": None, "code": "engine_error"}
    return frame({"error": detail, **(extra or {})})


def choice_usage(job: Job, index: int) -> dict[str, int]:
    """Choice ``index``'s own counts so far, as a gateway reads them (``atrium_choice_usage``):
    a stream of ``n`` choices has one ``usage``, which counts the prompt once."""
    choice = job.choices[index]
    return {
        "index": index,
        "completion_tokens": choice.completion_tokens,
        "cached_tokens": choice.cached_tokens,
    }


async def _outputs(
    job: Job, first: RequestOutput, rest: AsyncIterator[RequestOutput]
) -> AsyncIterator[RequestOutput]:
    yield first
    if not job.done:  # one choice's end is not the answer's while another is running
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
    continuous_usage: bool = False,
    tools: ChatStreamTools | None = None,
) -> AsyncIterator[bytes]:
    """Chunks of ``chat.completion.chunk``: each choice's role first, then text deltas (with
    their tokens' logprobs when asked) and each choice's finish reason.

    With ``continuous_usage`` (vLLM's ``stream_options.continuous_usage_stats``) every chunk
    carries the usage so far, so a reader cut off mid-stream knows what it was sent.
    """

    names = TokenNames(service.runtime.tokenizer)

    def chunk(
        index: int,
        delta: Delta,
        finish_reason: str | None = None,
        logprobs: ChatLogprobs | None = None,
    ) -> bytes:
        choice = ChatChunkChoice(index, delta, finish_reason, logprobs)
        usage = usage_of(job) if continuous_usage else None
        return frame(ChatCompletionChunk(job.request_id, job.created, model, [choice], usage))

    for choice in job.choices:
        yield chunk(choice.index, Delta(role="assistant", content=""))
    async for out in _outputs(job, first, rest):
        index = job.choice_of(out).index
        logprobs = chat_logprobs(names, out.logprobs) if out.logprobs else None
        if tools is not None:  # text, or tool calls parsed out of it (web/openai/chat.py)
            deltas = tools.feed(index, out.text) if out.text else []
            for delta in deltas or ([Delta()] if logprobs is not None else []):
                yield chunk(index, delta, logprobs=logprobs)
                logprobs = None
        elif out.text or logprobs is not None:
            yield chunk(index, Delta(content=out.text), logprobs=logprobs)
        if out.finished:
            if out.finish_reason == "error":
                yield error_frame(out.error or "generation failed")
            elif tools is not None:
                deltas, reason = tools.finish(index, out.finish_reason)
                for delta in deltas:
                    yield chunk(index, delta)
                yield chunk(index, Delta(), reason)
            else:
                yield chunk(index, Delta(), out.finish_reason)
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
    continuous_usage: bool = False,
    echo: Mapping[int, str] | None = None,
    for_gateway: bool = False,
) -> AsyncIterator[bytes]:
    """Chunks of ``text_completion``: text deltas (after the prompt's text, by choice index,
    with ``echo``; with their tokens' logprobs when asked), then an empty one with each
    choice's finish reason (with ``continuous_usage``, each with the usage so far). With
    ``for_gateway`` (an engine answering its gateway), every chunk of a choice, its error
    included, also carries that choice's counts as ``atrium_choice_usage`` (``{index,
    completion_tokens, cached_tokens}``), and a chunk with logprobs carries them by token id as
    ``atrium_logprobs``: ``[[token_id, logprob, [[id, logprob], ...]], ...]``."""
    names = TokenNames(service.runtime.tokenizer)
    offsets = {choice.index: 0 for choice in job.choices}  # characters sent per choice

    def chunk(
        index: int,
        text: str,
        finish_reason: str | None = None,
        logprobs: CompletionLogprobs | None = None,
        raw: list[TokenLogprob] | None = None,
    ) -> bytes:
        offsets[index] += len(text)
        choice = TextChoice(index, text, finish_reason, logprobs)
        usage = usage_of(job) if continuous_usage else None
        payload = TextCompletion(job.request_id, job.created, model, [choice], usage)
        if not for_gateway:
            return frame(payload)
        extra: dict[str, object] = {"atrium_choice_usage": choice_usage(job, index)}
        if raw is not None:
            extra["atrium_logprobs"] = raw
        return frame({**msgspec.to_builtins(payload), **extra})

    for index, text in (echo or {}).items():
        yield chunk(index, text)
    async for out in _outputs(job, first, rest):
        index = job.choice_of(out).index
        logprobs = None
        if out.logprobs:
            logprobs = completion_logprobs(names, out.logprobs, offsets[index])
        if out.text or logprobs is not None:
            raw = out.logprobs if for_gateway and out.logprobs else None
            yield chunk(index, out.text, logprobs=logprobs, raw=raw)
        if out.finished:
            if out.finish_reason == "error":
                extra = {"atrium_choice_usage": choice_usage(job, index)} if for_gateway else None
                yield error_frame(out.error or "generation failed", extra)
            else:
                yield chunk(index, "", out.finish_reason)
    if include_usage:
        yield frame(TextCompletion(job.request_id, job.created, model, [], usage_of(job)))
    await service.wait_recorded(job)
    yield DONE
