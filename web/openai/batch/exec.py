"""One Batch API line run through the interactive generation path, not streamed.

The body is decoded, checked, admitted (quotas, budget) and generated exactly as
`/v1/chat/completions` and `/v1/completions` do it, by the same helpers; the answer is the JSON
the route would have sent. Refusals leave as exceptions for the runner to sort.
"""

from __future__ import annotations

from typing import Any

import msgspec

from web.openai import chat, schemas
from web.openai.choices import check_completion_options, collect, echo_texts, prompt_token_ids
from web.openai.fields import CHAT, COMPLETION, decode_request
from web.openai.generation import GenerationService, Job
from web.openai.logprobs import TokenNames, chat_logprobs, completion_logprobs
from web.openai.structured_output import checked_grammar
from web.ops.errors import ApiError
from web.tenancy.principal import Principal

CHAT_URL = "/v1/chat/completions"


async def run_line(
    service: GenerationService, principal: Principal, url: str, body: bytes, request_id: str
) -> dict[str, Any]:
    """The response body of one line (raises ApiError, TenantError or EngineError)."""
    if url == CHAT_URL:
        return await _chat(service, principal, body, request_id)
    return await _completion(service, principal, body, request_id)


def _plain(value: Any) -> dict[str, Any]:
    result: dict[str, Any] = msgspec.to_builtins(value)
    return result


async def _chat(
    service: GenerationService, principal: Principal, raw: bytes, request_id: str
) -> dict[str, Any]:
    body = decode_request(raw, schemas.ChatCompletionRequest, CHAT)
    adapter = await service.resolve_model(body.model, principal)
    n = schemas.check_n(body.n)
    messages = schemas.chat_messages(body)
    plan, grammar = await chat.chat_plan(body)
    service.check_open()
    prompt_ids = await chat.chat_prompt(service.runtime.tokenizer, messages, plan)
    requested = body.max_completion_tokens or body.max_tokens
    param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    if body.max_completion_tokens is not None and body.max_completion_tokens <= 0:
        raise ApiError(
            400, "max_completion_tokens must be positive", code="invalid_request", param=param
        )
    max_tokens = service.resolve_max_tokens(len(prompt_ids), requested, "messages")
    await chat.check_fits(service, grammar, max_tokens, param)
    params = chat.constrained(schemas.sampling_params(body, max_tokens), grammar)
    job = await service.admit_choices(
        principal, "chat", request_id, [(prompt_ids, params)], n, adapter=adapter
    )
    outputs = service.outputs(job)
    answers = await collect(service, job, await service.first_output(job, outputs), outputs)
    names = TokenNames(service.runtime.tokenizer)
    choices = []
    for answer in answers:
        message, reason = chat.chat_message(plan, answer.text, answer.finish_reason)
        logprobs = None if answer.logprobs is None else chat_logprobs(names, answer.logprobs)
        choices.append(schemas.ChatChoice(answer.index, message, reason, logprobs))
    return _plain(
        schemas.ChatCompletion(job.request_id, job.created, body.model, choices, _usage(job))
    )


async def _completion(
    service: GenerationService, principal: Principal, raw: bytes, request_id: str
) -> dict[str, Any]:
    body = decode_request(raw, schemas.CompletionRequest, COMPLETION)
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
        principal, "completion", request_id, prompts, n, adapter=adapter
    )
    echo = await echo_texts(service, job) if body.echo else None
    outputs = service.outputs(job)
    answers = await collect(service, job, await service.first_output(job, outputs), outputs)
    names = TokenNames(service.runtime.tokenizer)
    choices = []
    for answer in answers:
        prefix = (echo or {}).get(answer.index, "")
        logprobs = None
        if answer.logprobs is not None:
            logprobs = completion_logprobs(names, answer.logprobs, len(prefix))
        choices.append(
            schemas.TextChoice(answer.index, prefix + answer.text, answer.finish_reason, logprobs)
        )
    return _plain(
        schemas.TextCompletion(job.request_id, job.created, body.model, choices, _usage(job))
    )


def _usage(job: Job) -> schemas.Usage:
    return schemas.Usage.of(job.prompt_tokens, job.cached_tokens, job.completion_tokens)
