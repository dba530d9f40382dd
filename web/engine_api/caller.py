"""The engine role's caller: a gateway holding the engine token, naming the tenant in the body.

Its tenant fields (``wire.TenantFields``) are trusted: the tenant, its weight and cache share,
the prompt's token ids as the gateway counted them, its exact sampling settings and adapter.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from engine.sampling_params import SamplingParams
from tenants.lora_adapters import LoraAdapterInfo
from web.engine_api import wire
from web.openai.fields import CHAT
from web.openai.generation import GenerationService
from web.openai.pipeline import OpenAIRequest
from web.openai.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    decode_body,
    sampling_params,
)
from web.ops.errors import bad_request
from web.tenancy.principal import Principal


@dataclass(slots=True)
class EngineCaller:
    """One request from a gateway; ``decode`` reads its tenant fields along with its body."""

    fields: wire.TenantFields | None = None

    def decode(self, raw: bytes, endpoint: str) -> OpenAIRequest:
        body: OpenAIRequest
        if endpoint == CHAT:
            body = decode_body(raw, ChatCompletionRequest)
        else:
            body = decode_body(raw, CompletionRequest)
        self.fields = decode_body(raw, wire.TenantFields)
        wire.check_fields(msgspec.json.decode(raw))
        return body

    @property
    def tenant(self) -> wire.TenantFields:
        if self.fields is None:
            raise RuntimeError("EngineCaller.decode has not read a body")
        return self.fields

    async def route(
        self, service: GenerationService, body: OpenAIRequest
    ) -> tuple[Principal, LoraAdapterInfo | None]:
        principal = principal_of(self.tenant)
        service.check_model(body.model)
        return principal, wire.adapter_of(self.tenant)

    async def prompt_ids(
        self, service: GenerationService, body: OpenAIRequest
    ) -> list[list[int]] | None:
        """The gateway's token ids; else one completion prompt (a chat's is templated)."""
        given = self.tenant.atrium_prompt_token_ids
        tokenizer = service.runtime.tokenizer
        if given is not None:
            return [wire.checked_ids(given, tokenizer, "atrium_prompt_token_ids")]
        if isinstance(body, ChatCompletionRequest):
            return None
        ids = await _one_prompt(service, body)
        if not ids:
            raise bad_request("the prompt must not be empty", "prompt")
        return [ids]

    def sampling(self, body: OpenAIRequest, max_tokens: int) -> SamplingParams:
        return wire.sampling_of(self.tenant) or sampling_params(body, max_tokens)

    def for_gateway(self, body: OpenAIRequest) -> bool:
        # A gateway reads logprobs by token id and each choice's counts (engine_api/client.py).
        return self.tenant.atrium_sampling is not None


def principal_of(fields: wire.TenantFields) -> Principal:
    return Principal(
        tenant_id=wire.tenant_id_of(fields),
        weight=wire.weight_of(fields),
        allow_public_prefix=fields.atrium_allow_public_prefix is not False,
        kv_cache_share=wire.cache_share_of(fields),
        background=fields.atrium_background is True,
        tenant_requests=wire.tenant_requests_of(fields),
    )


async def _one_prompt(service: GenerationService, body: CompletionRequest) -> list[int]:
    """One prompt per engine request: a string, a one-string list, or token ids."""
    prompt: object = body.prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return await service.tokenize_text(prompt)
    if isinstance(prompt, list) and all(type(token) is int for token in prompt):
        return wire.checked_ids(list(prompt), service.runtime.tokenizer, "prompt")
    raise bad_request("an engine request takes one prompt", "prompt")
