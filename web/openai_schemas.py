"""OpenAI-compatible request and response bodies as msgspec structs, and strict body decoding.

Request structs accept unknown fields (the official client sends fields we may not know) but
reject wrong types; a decode failure becomes a 400 naming the offending parameter.
"""

from __future__ import annotations

import re
from typing import Literal, TypeVar

import msgspec

from engine.sampling_params import SamplingParams
from web.errors import bad_request
from web.json_body import decode_json

ROLES = ("system", "developer", "user", "assistant", "tool")
_AT_PATH = re.compile(r"at `\$\.?([^`]*)`")
_MISSING = re.compile(r"missing required field `([^`]+)`")

T = TypeVar("T")


class TextPart(msgspec.Struct):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None


class StreamOptions(msgspec.Struct):
    include_usage: bool | None = None


class _GenerationFields(msgspec.Struct, kw_only=True):
    """Fields chat and text completions share (unknown fields are ignored, wrong types are not)."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool | None = None  # extension (as in vLLM): run to max_tokens
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None


class ChatCompletionRequest(_GenerationFields, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None


class CompletionRequest(_GenerationFields, kw_only=True):
    prompt: str


def decode_body(body: bytes, type_: type[T]) -> T:
    """Decode a JSON body into ``type_``; malformed JSON or wrong types raise a 400 ApiError."""
    return decode_json(body, type_, _param_of)


def _param_of(message: str) -> str | None:
    path = _AT_PATH.search(message)
    missing = _MISSING.search(message)
    prefix = path.group(1) if path else ""
    if missing:
        return f"{prefix}.{missing.group(1)}" if prefix else missing.group(1)
    return prefix or None


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails

    @classmethod
    def of(cls, prompt: int, cached: int, completion: int) -> Usage:
        return cls(prompt, completion, prompt + completion, PromptTokensDetails(cached))


class AssistantMessage(msgspec.Struct):
    role: Literal["assistant"]
    content: str


class ChatChoice(msgspec.Struct):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: None = None


class ChatCompletion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: Literal["chat.completion"] = "chat.completion"


class Delta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: Delta
    finish_reason: str | None
    logprobs: None = None


class ChatCompletionChunk(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"


class TextChoice(msgspec.Struct):
    index: int
    text: str
    finish_reason: str | None
    logprobs: None = None


class TextCompletion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[TextChoice]
    usage: Usage | None = None
    object: Literal["text_completion"] = "text_completion"


class ModelCard(msgspec.Struct):
    id: str
    created: int
    owned_by: str = "atrium"
    object: Literal["model"] = "model"


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: Literal["list"] = "list"


def chat_messages(request: ChatCompletionRequest) -> list[dict[str, str]]:
    """The messages as the chat template takes them; bad roles or contents raise a 400."""
    if not request.messages:
        raise bad_request("messages must be a non-empty list", "messages")
    rendered: list[dict[str, str]] = []
    for index, message in enumerate(request.messages):
        if message.role not in ROLES:
            raise bad_request(
                f"Invalid role {message.role!r}; expected one of {', '.join(ROLES)}",
                f"messages[{index}].role",
            )
        content = message.content
        if isinstance(content, list):
            if any(part.type != "text" or part.text is None for part in content):
                raise bad_request(
                    "Only text content parts are supported", f"messages[{index}].content"
                )
            content = "".join(part.text or "" for part in content)
        if content is None:
            if message.role in ("user", "system", "developer"):
                raise bad_request("content is required", f"messages[{index}].content")
            content = ""
        role = "system" if message.role == "developer" else message.role
        rendered.append({"role": role, "content": content})
    return rendered


def check_n(n: int | None) -> None:
    if n is not None and n != 1:
        raise bad_request("n > 1 is unsupported: only one choice per request (n=1)", "n")


def stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


def sampling_params(
    request: ChatCompletionRequest | CompletionRequest, max_tokens: int
) -> SamplingParams:
    """Sampling settings with OpenAI's defaults (temperature 1, top_p 1); validated later."""
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if request.temperature is None else request.temperature,
        top_p=1.0 if request.top_p is None else request.top_p,
        top_k=0 if request.top_k is None else request.top_k,
        min_p=0.0 if request.min_p is None else request.min_p,
        seed=request.seed,
        stop=stop_strings(request.stop),
        ignore_eos=bool(request.ignore_eos),
    )


def include_usage(request: ChatCompletionRequest | CompletionRequest) -> bool:
    return bool(request.stream_options and request.stream_options.include_usage)
