"""The engine role's model-server routes: OpenAI completions and chat (SSE), models, probes.

Generation goes through the same ``GenerationService``, schemas and SSE rendering as the
tenant API; the tenant is whoever the (token-holding) gateway names in the body.
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from litestar import Request, Response, get, post
from litestar.response import Stream

from engine.outputs import RequestOutput
from web.engine_api import wire
from web.openai import schemas, sse
from web.openai.generation import GenerationService, Job
from web.ops.errors import ApiError, bad_request
from web.tenancy.principal import Principal


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


async def _first(outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
    """The first output, awaited before any byte is sent so that early failures are HTTP errors."""
    async for out in outputs:
        return out
    raise ApiError(503, "The engine ended the request without output.", code="engine_error")


async def _full_text(
    service: GenerationService, job: Job, first: RequestOutput, rest: AsyncIterator[RequestOutput]
) -> str:
    text = [first.text]
    if not first.finished:
        text.extend([out.text async for out in rest])
    await service.wait_recorded(job)
    return "".join(text)


def _service(request: Request[Any, Any, Any]) -> GenerationService:
    service: GenerationService = request.app.state.generation
    return service


def _principal(fields: wire.TenantFields) -> Principal:
    return Principal(
        tenant_id=wire.tenant_id_of(fields),
        weight=wire.weight_of(fields),
        allow_public_prefix=fields.atrium_allow_public_prefix is not False,
        kv_cache_share=wire.cache_share_of(fields),
        background=fields.atrium_background is True,
        tenant_requests=wire.tenant_requests_of(fields),
    )


async def _prompt_ids(
    service: GenerationService, fields: wire.TenantFields, tokenize: Any, param: str
) -> list[int]:
    ids = fields.atrium_prompt_token_ids
    if ids is not None:
        ids = wire.checked_ids(ids, service.runtime.tokenizer, "atrium_prompt_token_ids")
    else:
        ids = list(await tokenize())
    if not ids:
        raise bad_request("the prompt must not be empty", param)
    return ids


async def _answer(
    service: GenerationService,
    job: Job,
    body: wire.TenantFields,
    chat: bool,
) -> Response[Any]:
    outputs = service.outputs(job)
    first = await _first(outputs)
    headers = {"x-request-id": job.request_id}
    if body.stream:
        with_usage = schemas.include_usage(body)
        continuous = schemas.continuous_usage(body)
        events = (
            sse.chat_events(service, job, model=body.model, first=first, rest=outputs,
                            include_usage=with_usage, continuous_usage=continuous)
            if chat
            # A gateway reads logprobs by token id (web/engine_api/client.py).
            else sse.completion_events(service, job, model=body.model, first=first,
                                       rest=outputs, include_usage=with_usage,
                                       continuous_usage=continuous,
                                       raw_logprobs=body.atrium_sampling is not None)
        )  # fmt: skip
        return Stream(events, media_type=sse.MEDIA_TYPE, headers={**sse.HEADERS, **headers})
    text = await _full_text(service, job, first, outputs)
    usage = sse.usage_of(job)
    result: Any
    if chat:
        message = schemas.AssistantMessage(role="assistant", content=text)
        choice = schemas.ChatChoice(index=0, message=message, finish_reason=job.finish_reason)
        result = schemas.ChatCompletion(job.request_id, job.created, body.model, [choice], usage)
    else:
        text_choice = schemas.TextChoice(index=0, text=text, finish_reason=job.finish_reason)
        result = schemas.TextCompletion(
            job.request_id, job.created, body.model, [text_choice], usage
        )
    return Response(result, headers=headers)


async def _tokenize_prompt(
    service: GenerationService, body: wire.EngineCompletionRequest
) -> list[int]:
    """One prompt per engine request: a string, a one-string list, or token ids."""
    prompt: object = body.prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return await service.tokenize_text(prompt)
    if isinstance(prompt, list) and all(type(token) is int for token in prompt):
        return wire.checked_ids(list(prompt), service.runtime.tokenizer, "prompt")
    raise bad_request("an engine request takes one prompt", "prompt")


@post("/v1/completions", status_code=200)
async def completions(request: Request[Any, Any, Any]) -> Response[Any]:
    service = _service(request)
    with service.arriving():
        raw = await request.body()
        body = schemas.decode_body(raw, wire.EngineCompletionRequest)
        wire.check_fields(msgspec.json.decode(raw))
        principal = _principal(body)
        service.check_model(body.model)
        schemas.check_n(body.n)
        service.check_open()
        ids = await _prompt_ids(service, body, lambda: _tokenize_prompt(service, body), "prompt")
        max_tokens = service.resolve_max_tokens(len(ids), body.max_tokens, "prompt")
        params = wire.sampling_of(body) or schemas.sampling_params(body, max_tokens)
        rid = f"cmpl-{secrets.token_hex(12)}"
        adapter = wire.adapter_of(body)
        job = await service.admit_choices(
            principal, "completion", rid, [(ids, params)], adapter=adapter
        )
    return await _answer(service, job, body, chat=False)


@post("/v1/chat/completions", status_code=200)
async def chat_completions(request: Request[Any, Any, Any]) -> Response[Any]:
    service = _service(request)
    with service.arriving():
        raw = await request.body()
        body = schemas.decode_body(raw, wire.EngineChatRequest)
        wire.check_fields(msgspec.json.decode(raw))
        principal = _principal(body)
        service.check_model(body.model)
        schemas.check_n(body.n)
        service.check_open()
        messages = schemas.chat_messages(body)
        ids = await _prompt_ids(service, body, lambda: service.tokenize_chat(messages), "messages")
        requested = body.max_completion_tokens or body.max_tokens
        max_tokens = service.resolve_max_tokens(len(ids), requested, "messages")
        params = wire.sampling_of(body) or schemas.sampling_params(body, max_tokens)
        rid = f"chatcmpl-{secrets.token_hex(12)}"
        adapter = wire.adapter_of(body)
        job = await service.admit_choices(principal, "chat", rid, [(ids, params)], adapter=adapter)
    return await _answer(service, job, body, chat=True)


@get("/v1/models")
async def list_models(request: Request[Any, Any, Any]) -> EngineModelList:
    runtime = _service(request).runtime
    card = EngineModelCard(
        id=runtime.name,
        created=0,
        max_model_len=runtime.max_model_len,
        kv_capacity_tokens=runtime.kv_capacity_tokens,
    )
    return EngineModelList([card])


ROUTES = [completions, chat_completions, list_models]
