"""One way from an OpenAI request body to an admitted job and its answer, streamed or collected.

The tenant API, Batch API lines and the engine role all go through ``GenerationPipeline``; what
differs between them (whom a request runs for, what of its body is trusted) is a ``Caller``.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from litestar import Request, Response
from litestar.response import Stream
from opentelemetry.context import Context

from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from tenants.lora_adapters import LoraAdapterInfo
from web.openai import chat, sse
from web.openai.choices import check_completion_options, collect, echo_texts, prompt_token_ids
from web.openai.fields import CHAT, COMPLETION, decode_request
from web.openai.generation import GenerationService, Job
from web.openai.json_body import client_closed
from web.openai.logprobs import TokenNames, chat_logprobs, completion_logprobs
from web.openai.schemas import (
    ChatChoice,
    ChatCompletion,
    ChatCompletionRequest,
    CompletionRequest,
    TextChoice,
    TextCompletion,
    chat_messages,
    check_n,
    continuous_usage,
    include_usage,
    sampling_params,
)
from web.openai.structured_output import checked_grammar
from web.openai.tools import ToolPlan
from web.ops.errors import ApiError
from web.ops.request_log import RequestTrail
from web.tenancy.principal import Principal

T = TypeVar("T")
OpenAIRequest = ChatCompletionRequest | CompletionRequest
Completion = ChatCompletion | TextCompletion
REQUEST_ID_PREFIXES = {CHAT: "chatcmpl", COMPLETION: "cmpl"}


class Caller(Protocol):
    """Who sends a request: how its body is read and what of it is trusted."""

    def decode(self, raw: bytes, endpoint: str) -> OpenAIRequest:
        """The body as the endpoint's request type (a 400 for anything the caller may not send)."""
        ...

    async def route(
        self, service: GenerationService, body: OpenAIRequest
    ) -> tuple[Principal, LoraAdapterInfo | None]:
        """Whom the request runs for, and the LoRA adapter it names; routes it to its model."""
        ...

    async def prompt_ids(
        self, service: GenerationService, body: OpenAIRequest
    ) -> list[list[int]] | None:
        """The prompts as the caller already counted them, or None to tokenize the body's."""
        ...

    def sampling(self, body: OpenAIRequest, max_tokens: int) -> SamplingParams: ...

    def for_gateway(self, body: OpenAIRequest) -> bool:
        """Whether the answer goes to a gateway: streamed completion chunks also carry each
        choice's own counts and logprobs by token id."""
        ...


@dataclass(frozen=True, slots=True)
class KeyCaller:
    """A tenant's API key, already authenticated: the tenant API and Batch API lines."""

    principal: Principal

    def decode(self, raw: bytes, endpoint: str) -> OpenAIRequest:
        if endpoint == CHAT:
            return decode_request(raw, ChatCompletionRequest, CHAT)
        return decode_request(raw, CompletionRequest, COMPLETION)

    async def route(
        self, service: GenerationService, body: OpenAIRequest
    ) -> tuple[Principal, LoraAdapterInfo | None]:
        return self.principal, await service.resolve_model(body.model, self.principal)

    async def prompt_ids(
        self, service: GenerationService, body: OpenAIRequest
    ) -> list[list[int]] | None:
        return None

    def sampling(self, body: OpenAIRequest, max_tokens: int) -> SamplingParams:
        return sampling_params(body, max_tokens)

    def for_gateway(self, body: OpenAIRequest) -> bool:
        return False


@dataclass(slots=True)
class Admitted:
    """An admitted request: its job, its body and what rendering its answer needs."""

    job: Job
    body: OpenAIRequest
    plan: ToolPlan | None = None  # the chat request's tools
    echo: dict[int, str] | None = None  # each choice's prompt text, for ``echo``
    for_gateway: bool = False

    @property
    def headers(self) -> dict[str, str]:
        """The admission's ``x-ratelimit-*`` (``x-request-id`` is every response's: see
        ``web.ops.request_id``)."""
        return dict(self.job.ticket.headers)


def new_request_id(endpoint: str) -> str:
    """A fresh completion id (``chatcmpl-…``, ``cmpl-…``): the engine's and the usage event's."""
    return f"{REQUEST_ID_PREFIXES[endpoint]}-{secrets.token_hex(12)}"


class GenerationPipeline:
    """Decode, template, size, constrain and admit a request; then stream or collect it."""

    def __init__(self, service: GenerationService) -> None:
        self.service = service

    def arriving(self) -> contextlib.AbstractContextManager[None]:
        """Count a request as arriving until it is admitted or refused."""
        return self.service.arriving()

    async def admit(
        self,
        raw: bytes,
        endpoint: str,
        caller: Caller,
        *,
        request_id: str | None = None,
        trace_parent: Context | None = None,
        trail: RequestTrail | None = None,
    ) -> Admitted:
        """The request admitted (quotas, budget, the fair gate), or a refusal raised; ``trail``
        (its log line) learns whom it runs for, and goes with its job."""
        service = self.service
        body = caller.decode(raw, endpoint)
        principal, adapter = await caller.route(service, body)
        if trail is not None:
            trail.note(
                tenant=principal.tenant_id,
                key_id=principal.key_id,
                model=body.model,
                batch_id=principal.batch_id,
            )
        plan: ToolPlan | None = None
        if isinstance(body, ChatCompletionRequest):
            n = check_n(body.n)
            messages = chat_messages(body)
            plan, grammar = await chat.chat_plan(body)
            service.check_open()
            ids = await caller.prompt_ids(service, body)
            if ids is None:
                tokenizer = service.runtime.tokenizer
                ids = [await chat.chat_prompt(tokenizer, messages, plan)]
            requested, prompt_param, param = _chat_max_tokens(body)
        else:
            n = check_completion_options(body)
            grammar = await checked_grammar(body)
            service.check_open()
            ids = await caller.prompt_ids(service, body)
            if ids is None:
                ids = await prompt_token_ids(service, body.prompt)
            requested, prompt_param, param = body.max_tokens, "prompt", "max_tokens"
        prompts = []
        for prompt in ids:
            max_tokens = service.resolve_max_tokens(len(prompt), requested, prompt_param)
            await chat.check_fits(service, grammar, max_tokens, param)
            params = chat.constrained(caller.sampling(body, max_tokens), grammar)
            prompts.append((prompt, params))
        request_id = request_id or new_request_id(endpoint)
        job = await service.admit_choices(
            principal, endpoint, request_id, prompts, n, trace_parent, adapter, trail
        )
        echo = None
        if isinstance(body, CompletionRequest) and body.echo:
            echo = await echo_texts(service, job)
        return Admitted(job, body, plan, echo, caller.for_gateway(body))

    async def respond(
        self, admitted: Admitted, connection: Request[Any, Any, Any] | None = None
    ) -> Response[Any]:
        """The HTTP answer: SSE when the body asks for a stream, else the whole completion.
        With ``connection``, a client gone before the first token (or an unstreamed answer)
        aborts the engine request at once."""
        job = admitted.job
        outputs = self.service.outputs(job)
        first = await _watched(connection, self.service.first_output(job, outputs))
        if admitted.body.stream:
            events = self._events(admitted, first, outputs)
            headers = {**sse.HEADERS, **admitted.headers}
            return Stream(events, media_type=sse.MEDIA_TYPE, headers=headers)
        result = await _watched(connection, self._collected(admitted, first, outputs))
        return Response(result, headers=admitted.headers)

    async def collect(self, admitted: Admitted) -> Completion:
        """The whole completion, once its usage is recorded (whatever ``stream`` says)."""
        outputs = self.service.outputs(admitted.job)
        first = await self.service.first_output(admitted.job, outputs)
        return await self._collected(admitted, first, outputs)

    def _events(
        self, admitted: Admitted, first: RequestOutput, rest: AsyncIterator[RequestOutput]
    ) -> AsyncIterator[bytes]:
        body, job, service = admitted.body, admitted.job, self.service
        with_usage, continuous = include_usage(body), continuous_usage(body)
        if isinstance(body, ChatCompletionRequest):
            tools = None if admitted.plan is None else chat.ChatStreamTools(admitted.plan)
            return sse.chat_events(service, job, model=body.model, first=first, rest=rest,
                                   include_usage=with_usage, continuous_usage=continuous,
                                   tools=tools)  # fmt: skip
        return sse.completion_events(service, job, model=body.model, first=first, rest=rest,
                                     include_usage=with_usage, continuous_usage=continuous,
                                     echo=admitted.echo,
                                     for_gateway=admitted.for_gateway)  # fmt: skip

    async def _collected(
        self, admitted: Admitted, first: RequestOutput, rest: AsyncIterator[RequestOutput]
    ) -> Completion:
        body, job = admitted.body, admitted.job
        answers = await collect(self.service, job, first, rest)
        names = TokenNames(self.service.runtime.tokenizer)
        usage = sse.usage_of(job)
        if isinstance(body, ChatCompletionRequest):
            chat_choices = []
            for answer in answers:
                message, reason = chat.chat_message(
                    admitted.plan, answer.text, answer.finish_reason
                )
                logprobs = (
                    None if answer.logprobs is None else chat_logprobs(names, answer.logprobs)
                )
                chat_choices.append(ChatChoice(answer.index, message, reason, logprobs))
            return ChatCompletion(job.request_id, job.created, body.model, chat_choices, usage)
        text_choices = []
        for answer in answers:
            prefix = (admitted.echo or {}).get(answer.index, "")
            text_logprobs = None
            if answer.logprobs is not None:
                text_logprobs = completion_logprobs(names, answer.logprobs, len(prefix))
            text = prefix + answer.text
            text_choices.append(TextChoice(answer.index, text, answer.finish_reason, text_logprobs))
        return TextCompletion(job.request_id, job.created, body.model, text_choices, usage)


def _chat_max_tokens(body: ChatCompletionRequest) -> tuple[int | None, str, str]:
    """The chat request's token limit, the prompt's param name and the limit's."""
    param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    if body.max_completion_tokens is not None and body.max_completion_tokens <= 0:
        raise ApiError(
            400, "max_completion_tokens must be positive", code="invalid_request", param=param
        )
    return body.max_completion_tokens or body.max_tokens, "messages", param


async def _watched(connection: Request[Any, Any, Any] | None, work: Awaitable[T]) -> T:
    return await (work if connection is None else while_connected(connection, work))


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
        raise client_closed()
    return task.result()


async def _disconnected(request: Request[Any, Any, Any]) -> None:
    """Return once the client has gone (the body has been read: nothing else comes)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
