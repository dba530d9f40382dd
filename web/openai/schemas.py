"""OpenAI-compatible request and response bodies as msgspec structs, and strict body decoding.

Request structs accept unknown fields (the official client sends fields we may not know) but
reject wrong types; a decode failure becomes a 400 naming the offending parameter.
"""

from __future__ import annotations

import re
from typing import Any, Literal, TypeVar

import msgspec

from engine.sampling_params import MAX_LOGPROBS, SamplingParams
from web.openai.json_body import decode_json
from web.openai.structured_output import ResponseFormat, StructuredOutputs
from web.openai.tools import DeltaToolCall, NamedToolChoice, ToolCall, ToolDef
from web.ops.errors import bad_request

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_N = 16  # choices per prompt
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
    tool_calls: list[ToolCall] | None = None  # assistant: the calls it made
    tool_call_id: str | None = None  # tool: the call this answers


class StreamOptions(msgspec.Struct):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None  # extension (as in vLLM): usage in every chunk


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
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # extension (as in vLLM)
    logit_bias: dict[str, float] | None = None
    stop_token_ids: list[int] | None = None  # extension (as in vLLM)
    include_stop_str_in_output: bool | None = None  # extension (as in vLLM)
    min_tokens: int | None = None  # extension (as in vLLM)
    # Structured output (web/openai/structured_output.py): at most one of these.
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None  # extension (as in vLLM)
    guided_regex: str | None = None  # extension (as in vLLM)
    guided_choice: list[str] | None = None  # extension (as in vLLM)
    structured_outputs: StructuredOutputs | None = None  # extension (as in vLLM)


class ChatCompletionRequest(_GenerationFields, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[ToolDef] | None = None  # web/openai/tools.py
    tool_choice: str | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None


class CompletionRequest(_GenerationFields, kw_only=True):
    # A string, strings, token ids, or lists of token ids: one choice (times n) per prompt.
    prompt: str | list[str | int | list[int]]
    logprobs: int | None = None
    echo: bool | None = None
    best_of: int | None = None


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


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct):
    content: list[ChatTokenLogprob] | None
    refusal: None = None


class CompletionLogprobs(msgspec.Struct):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class AssistantMessage(msgspec.Struct, omit_defaults=True):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(msgspec.Struct):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None


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
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: Delta
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None


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
    logprobs: CompletionLogprobs | None = None


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
    parent: str | None = None  # a LoRA adapter's base model (as vLLM lists adapters)


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: Literal["list"] = "list"


def chat_messages(request: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The messages as the chat template takes them; bad roles or contents raise a 400."""
    if not request.messages:
        raise bad_request("messages must be a non-empty list", "messages")
    rendered: list[dict[str, Any]] = []
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
        entry: dict[str, Any] = {"role": role, "content": content}
        if message.tool_calls and role == "assistant":
            entry["tool_calls"] = msgspec.to_builtins(message.tool_calls)
        if message.tool_call_id is not None and role == "tool":
            entry["tool_call_id"] = message.tool_call_id
        rendered.append(entry)
    return rendered


def check_n(n: int | None) -> int:
    """The number of choices per prompt (1 to ``MAX_N``)."""
    if n is None:
        return 1
    if not 1 <= n <= MAX_N:
        raise bad_request(f"n must be between 1 and {MAX_N}", "n")
    return n


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
        presence_penalty=request.presence_penalty or 0.0,
        frequency_penalty=request.frequency_penalty or 0.0,
        repetition_penalty=1.0
        if request.repetition_penalty is None
        else request.repetition_penalty,
        logit_bias=logit_bias(request.logit_bias),
        stop_token_ids=tuple(request.stop_token_ids or ()),
        include_stop_str_in_output=bool(request.include_stop_str_in_output),
        min_tokens=request.min_tokens or 0,
        logprobs=num_logprobs(request),
    )


def logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's map of token ids (as strings) to biases; a key that is not an id is a 400."""
    pairs = []
    for key, value in (bias or {}).items():
        if not key.strip().isdigit():
            raise bad_request(f"logit_bias keys must be token ids, not {key[:40]!r}", "logit_bias")
        pairs.append((int(key), float(value)))
    return tuple(pairs)


def num_logprobs(request: ChatCompletionRequest | CompletionRequest) -> int | None:
    """Alternatives per token the request asks for (None: no logprobs at all)."""
    if isinstance(request, CompletionRequest):
        return request.logprobs
    if not request.logprobs:
        if request.top_logprobs is not None:
            raise bad_request("top_logprobs requires logprobs: true", "top_logprobs")
        return None
    top = request.top_logprobs or 0
    if not 0 <= top <= MAX_LOGPROBS:
        raise bad_request(f"top_logprobs must be between 0 and {MAX_LOGPROBS}", "top_logprobs")
    return top


def include_usage(request: ChatCompletionRequest | CompletionRequest) -> bool:
    return bool(request.stream_options and request.stream_options.include_usage)


def continuous_usage(request: ChatCompletionRequest | CompletionRequest) -> bool:
    return bool(request.stream_options and request.stream_options.continuous_usage_stats)
