"""The OpenAI-compatible tenant API: `/v1/models`, `/v1/chat/completions`, `/v1/completions`."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

import structlog
from litestar import Request, Response, get, post
from litestar.response import Stream

from engine.outputs import RequestOutput
from web.openai import chat, schemas, sse, tokens, usage
from web.openai.choices import (
    check_completion_options,
    collect,
    echo_texts,
    prompt_token_ids,
)
from web.openai.fields import CHAT, COMPLETION, decode_request
from web.openai.generation import GenerationService, Job
from web.openai.logprobs import TokenNames, chat_logprobs, completion_logprobs
from web.openai.structured_output import checked_grammar
from web.ops.errors import ApiError
from web.ops.tracing import incoming_context
from web.tenancy.auth import INFERENCE, authenticate

T = TypeVar("T")


def _service(request: Request[Any, Any, Any]) -> GenerationService:
    service: GenerationService = request.app.state.generation
    return service


async def while_connected(request: Request[Any, Any, Any], work: Awaitable[T]) -> T:
    """``work``'s result, unless the client leaves first. A request waiting in the engine's queue,
    or a whole answer being computed, sends nothing until then, so nothing else notices: the
    engine would compute (and the tenant's fair share pay for) an answer nobody reads. On a
    disconnect ``work`` is cancelled, which aborts the engine request and records its usage as
    a disconnect, and 499 ends the handler (the client never sees it)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task  # the engine request is aborted and its usage recorded
        gone.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await gone
    if gone.done() and not gone.cancelled() and task.cancelled():
        raise ApiError(499, "The client closed the request.", code="client_closed_request")
    return task.result()


async def _disconnected(request: Request[Any, Any, Any]) -> None:
    """Return once the client has gone (the body has been read: nothing else comes)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _new_request_id(prefix: str) -> str:
    request_id = f"{prefix}-{secrets.token_hex(12)}"
    structlog.contextvars.bind_contextvars(request_id=request_id)
    return request_id


async def _full_text(
    service: GenerationService, job: Job, first: RequestOutput, rest: AsyncIterator[RequestOutput]
) -> str:
    """The whole answer of a non-streamed request, once its usage is recorded."""
    return (await collect(service, job, first, rest))[0].text


def _headers(job: Job) -> dict[str, str]:
    return {"x-request-id": job.request_id, **job.ticket.headers}


@get("/v1/models")
async def list_models(request: Request[Any, Any, Any]) -> schemas.ModelList:
    principal = await authenticate(request)
    service = _service(request)
    runtime = service.runtimes[0]  # adapters apply to the first served model
    cards = [schemas.ModelCard(id=r.name, created=0) for r in service.visible_runtimes(principal)]
    adapters = service.adapters
    if adapters is not None:  # the tenant's own adapters and those shared with every tenant
        for adapter in await adapters.list_adapters(principal.tenant_id):
            if principal.allows_model(adapter.name):
                created = int(adapter.created_at.timestamp())
                cards.append(
                    schemas.ModelCard(id=adapter.name, created=created, parent=runtime.name)
                )
    return schemas.ModelList(cards)


@post("/v1/chat/completions", status_code=200)
async def chat_completions(request: Request[Any, Any, Any]) -> Response[Any]:
    service = _service(request)
    with service.arriving():
        principal = await authenticate(request, INFERENCE)
        body = decode_request(await request.body(), schemas.ChatCompletionRequest, CHAT)
        adapter = await service.resolve_model(body.model, principal)
        n = schemas.check_n(body.n)
        messages = schemas.chat_messages(body)
        plan, grammar = await chat.chat_plan(body)
        service.check_open()
        prompt_ids = await chat.chat_prompt(service.runtime.tokenizer, messages, plan)
        requested = body.max_completion_tokens or body.max_tokens
        param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        if body.max_completion_tokens is not None and body.max_completion_tokens <= 0:
            raise ApiError(400, "max_completion_tokens must be positive", code="invalid_request",
                           param=param)  # fmt: skip
        max_tokens = service.resolve_max_tokens(len(prompt_ids), requested, "messages")
        await chat.check_fits(service, grammar, max_tokens, param)
        params = chat.constrained(schemas.sampling_params(body, max_tokens), grammar)
        job = await service.admit_choices(
            principal,
            "chat",
            _new_request_id("chatcmpl"),
            [(prompt_ids, params)],
            n,
            incoming_context(request.headers),
            adapter,
        )
    outputs = service.outputs(job)
    first = await while_connected(request, service.first_output(job, outputs))
    if body.stream:
        events = sse.chat_events(
            service,
            job,
            model=body.model,
            first=first,
            rest=outputs,
            include_usage=schemas.include_usage(body),
            continuous_usage=schemas.continuous_usage(body),
            tools=None if plan is None else chat.ChatStreamTools(plan),
        )
        return Stream(events, media_type=sse.MEDIA_TYPE, headers={**sse.HEADERS, **_headers(job)})
    answers = await while_connected(request, collect(service, job, first, outputs))
    names = TokenNames(service.runtime.tokenizer)
    choices = []
    for answer in answers:
        message, reason = chat.chat_message(plan, answer.text, answer.finish_reason)
        logprobs = None if answer.logprobs is None else chat_logprobs(names, answer.logprobs)
        choices.append(schemas.ChatChoice(answer.index, message, reason, logprobs))
    result = schemas.ChatCompletion(
        job.request_id, job.created, body.model, choices, sse.usage_of(job)
    )
    return Response(result, headers=_headers(job))


@post("/v1/completions", status_code=200)
async def completions(request: Request[Any, Any, Any]) -> Response[Any]:
    service = _service(request)
    with service.arriving():
        principal = await authenticate(request, INFERENCE)
        body = decode_request(await request.body(), schemas.CompletionRequest, COMPLETION)
        adapter = await service.resolve_model(body.model, principal)
        n = check_completion_options(body)
        grammar = await checked_grammar(body)
        service.check_open()
        prompts = []
        for ids in await prompt_token_ids(service, body.prompt):
            max_tokens = service.resolve_max_tokens(len(ids), body.max_tokens, "prompt")
            await chat.check_fits(service, grammar, max_tokens, "max_tokens")
            params = schemas.sampling_params(body, max_tokens)
            prompts.append((ids, chat.constrained(params, grammar)))
        job = await service.admit_choices(
            principal,
            "completion",
            _new_request_id("cmpl"),
            prompts,
            n,
            incoming_context(request.headers),
            adapter,
        )
        echo = await echo_texts(service, job) if body.echo else None
    outputs = service.outputs(job)
    first = await while_connected(request, service.first_output(job, outputs))
    if body.stream:
        events = sse.completion_events(
            service,
            job,
            model=body.model,
            first=first,
            rest=outputs,
            include_usage=schemas.include_usage(body),
            continuous_usage=schemas.continuous_usage(body),
            echo=echo,
        )
        return Stream(events, media_type=sse.MEDIA_TYPE, headers={**sse.HEADERS, **_headers(job)})
    answers = await while_connected(request, collect(service, job, first, outputs))
    names = TokenNames(service.runtime.tokenizer)
    choices = []
    for answer in answers:
        prefix = (echo or {}).get(answer.index, "")
        logprobs = None
        if answer.logprobs is not None:
            logprobs = completion_logprobs(names, answer.logprobs, len(prefix))
        text = prefix + answer.text
        choices.append(schemas.TextChoice(answer.index, text, answer.finish_reason, logprobs))
    result = schemas.TextCompletion(
        job.request_id, job.created, body.model, choices, sse.usage_of(job)
    )
    return Response(result, headers=_headers(job))


ROUTES = [list_models, chat_completions, completions, *tokens.ROUTES, *usage.ROUTES]
