"""Small tenant endpoints beside generation: one model's card, and vLLM's `/tokenize` and
`/detokenize` (the served model's tokenizer and chat template, nothing computed on the engine)."""

from __future__ import annotations

import asyncio
import re
from typing import Any, TypeVar

import msgspec
from litestar import Request, get, post
from litestar.params import FromPath

from engine.errors import InvalidRequestError
from web.openai import schemas
from web.openai.fields import unsupported
from web.openai.generation import GenerationService
from web.ops.errors import ApiError, bad_request
from web.tenancy.auth import authenticate

MAX_DETOKENIZE_IDS = 1 << 20
T = TypeVar("T")
_UNKNOWN = re.compile(r"unknown field `([^`]+)`")


class TokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's two forms: ``prompt`` (completions) or ``messages`` (chat, through the template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[schemas.ChatMessage] | None = None
    add_special_tokens: bool = False
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class TokenizeResponse(msgspec.Struct):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    tokens: list[int]
    model: str | None = None


class DetokenizeResponse(msgspec.Struct):
    prompt: str


def _service(request: Request[Any, Any, Any]) -> GenerationService:
    service: GenerationService = request.app.state.generation
    return service


async def _checked(request: Request[Any, Any, Any], type_: type[T]) -> tuple[GenerationService, T]:
    """The service and the body, once the key is valid and may call the body's model."""
    principal = await authenticate(request)
    service = _service(request)
    body = _decode(await request.body(), type_)
    model = getattr(body, "model", None)
    if model is not None:  # an adapter shares its base model's tokenizer
        await service.resolve_model(model, principal)
    return service, body


def _decode(body: bytes, type_: type[T]) -> T:
    """``type_`` from the body; an unknown field is refused by name, as everywhere else."""
    try:
        return schemas.decode_body(body, type_)
    except ApiError as exc:
        unknown = _UNKNOWN.search(exc.message)
        if unknown is None:
            raise
        prefix = f"{exc.param}." if exc.param else ""
        name = prefix + unknown.group(1)
        raise unsupported(f"Unrecognized request argument supplied: {name}", name) from exc


@get("/v1/models/{model_id:path}")
async def retrieve_model(
    request: Request[Any, Any, Any], model_id: FromPath[str]
) -> schemas.ModelCard:
    """The model's card; 404 for a model not served or not allowed to the key (names may hold
    slashes, as ``org/model`` does)."""
    name = model_id.lstrip("/")
    service = _service(request)
    adapter = await service.resolve_model(name, await authenticate(request))
    if adapter is None:
        return schemas.ModelCard(id=name, created=0)
    created = int(adapter.created_at.timestamp())
    return schemas.ModelCard(id=name, created=created, parent=service.runtime.name)


@post("/tokenize", status_code=200)
async def tokenize(request: Request[Any, Any, Any]) -> TokenizeResponse:
    service, body = await _checked(request, TokenizeRequest)
    tokenizer: Any = service.runtime.tokenizer
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("Send exactly one of prompt and messages.", "prompt")
    if body.messages is not None:
        chat = schemas.ChatCompletionRequest(model="", messages=body.messages)
        messages = schemas.chat_messages(chat)
        try:
            ids = await asyncio.to_thread(
                tokenizer.apply_chat_template, messages, body.add_generation_prompt
            )
        except InvalidRequestError as exc:
            raise bad_request(str(exc), exc.param or "messages") from exc
    else:
        ids = await asyncio.to_thread(tokenizer.encode, body.prompt or "", body.add_special_tokens)
    strs = None
    if body.return_token_strs:
        strs = [tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    return TokenizeResponse(len(ids), service.runtime.max_model_len, list(ids), strs)


@post("/detokenize", status_code=200)
async def detokenize(request: Request[Any, Any, Any]) -> DetokenizeResponse:
    service, body = await _checked(request, DetokenizeRequest)
    tokenizer: Any = service.runtime.tokenizer
    vocab_size = getattr(tokenizer, "vocab_size", None)
    if len(body.tokens) > MAX_DETOKENIZE_IDS or (
        isinstance(vocab_size, int) and any(not 0 <= t < vocab_size for t in body.tokens)
    ):
        raise bad_request(f"tokens must be ids in [0, {vocab_size})", "tokens")
    text = await asyncio.to_thread(tokenizer.decode, body.tokens)
    return DetokenizeResponse(text)


ROUTES = [retrieve_model, tokenize, detokenize]
