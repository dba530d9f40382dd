"""Every field the OpenAI chat and completions bodies may carry, and what this server does with it.

A field is honoured, accepted without effect on the result (``user``, ``metadata``, …), honoured
at its default value only, or refused with a 400 ``unsupported_parameter`` naming it; a field
that is not listed is refused too. Extensions take vLLM's names. A ``null`` value means unset.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec

from web.openai.json_body import invalid_json, unreadable_json
from web.openai.schemas import decode_body
from web.ops.errors import ApiError, bad_request

T = TypeVar("T")
CHAT = "chat"
COMPLETION = "completion"
BOTH = frozenset({CHAT, COMPLETION})


class Handling(enum.Enum):
    HONOURED = "honoured"
    NO_EFFECT = "accepted, no effect on the result"
    DEFAULT_ONLY = "honoured at its default value; other values refused"
    REFUSED = "refused"


@dataclass(frozen=True, slots=True)
class FieldRule:
    handling: Handling
    endpoints: frozenset[str] = BOTH
    extension: bool = False  # not OpenAI's: vLLM's name for it
    default: object = None  # the one value a DEFAULT_ONLY field takes
    note: str = ""


H, N, D, R = Handling.HONOURED, Handling.NO_EFFECT, Handling.DEFAULT_ONLY, Handling.REFUSED
ONLY_CHAT = frozenset({CHAT})
ONLY_COMPLETION = frozenset({COMPLETION})

FIELDS: Mapping[str, FieldRule] = {
    # -- OpenAI, both endpoints
    "model": FieldRule(H),
    "max_tokens": FieldRule(H),
    "temperature": FieldRule(H),
    "top_p": FieldRule(H),
    "seed": FieldRule(H),
    "stop": FieldRule(H, note="up to 16 strings"),
    "n": FieldRule(H, note="the prompt is computed once for all n"),
    "stream": FieldRule(H),
    "stream_options": FieldRule(H),
    "presence_penalty": FieldRule(H),
    "frequency_penalty": FieldRule(H),
    "logit_bias": FieldRule(H, note="token id (as a string) to a bias in [-100, 100]"),
    "logprobs": FieldRule(H, note="chat: a boolean; completions: the number of alternatives"),
    "user": FieldRule(N),
    # -- OpenAI, chat only
    "messages": FieldRule(H, ONLY_CHAT),
    "max_completion_tokens": FieldRule(H, ONLY_CHAT),
    "top_logprobs": FieldRule(H, ONLY_CHAT, note="0 to 20, with logprobs: true"),
    "metadata": FieldRule(N, ONLY_CHAT),
    "store": FieldRule(N, ONLY_CHAT, note="nothing is stored"),
    "service_tier": FieldRule(N, ONLY_CHAT),
    "safety_identifier": FieldRule(N, ONLY_CHAT),
    "prompt_cache_key": FieldRule(N, ONLY_CHAT, note="caching is per tenant regardless"),
    "prompt_cache_retention": FieldRule(N, ONLY_CHAT),
    "prediction": FieldRule(N, ONLY_CHAT, note="a latency hint; outputs are unchanged"),
    "modalities": FieldRule(D, ONLY_CHAT, default=["text"]),
    "audio": FieldRule(R, ONLY_CHAT),
    "reasoning_effort": FieldRule(R, ONLY_CHAT),
    "verbosity": FieldRule(R, ONLY_CHAT),
    "web_search_options": FieldRule(R, ONLY_CHAT),
    # Structured output (web/openai/structured_output.py) and tools (web/openai/tools.py).
    "response_format": FieldRule(H, note="text, json_object, json_schema (always enforced)"),
    "tools": FieldRule(H, ONLY_CHAT, note="functions only"),
    "tool_choice": FieldRule(H, ONLY_CHAT, note="none, auto, required or a named function"),
    "parallel_tool_calls": FieldRule(
        N, ONLY_CHAT, note="auto may call several tools; required and named call one"
    ),
    "functions": FieldRule(R, ONLY_CHAT),
    "function_call": FieldRule(R, ONLY_CHAT),
    # -- OpenAI, completions only
    "prompt": FieldRule(H, ONLY_COMPLETION, note="a string, strings, token ids or lists of them"),
    "echo": FieldRule(H, ONLY_COMPLETION, note="without logprobs"),
    "best_of": FieldRule(H, ONLY_COMPLETION, note="equal to n: choices are not ranked"),
    "suffix": FieldRule(R, ONLY_COMPLETION),
    # -- vLLM's extensions
    "top_k": FieldRule(H, extension=True),
    "min_p": FieldRule(H, extension=True),
    "repetition_penalty": FieldRule(H, extension=True),
    "stop_token_ids": FieldRule(H, extension=True),
    "include_stop_str_in_output": FieldRule(H, extension=True),
    "ignore_eos": FieldRule(H, extension=True),
    "min_tokens": FieldRule(H, extension=True),
    "skip_special_tokens": FieldRule(D, extension=True, default=True),
    "add_generation_prompt": FieldRule(D, ONLY_CHAT, extension=True, default=True),
    "continue_final_message": FieldRule(D, ONLY_CHAT, extension=True, default=False),
    "add_special_tokens": FieldRule(D, extension=True, default=False),
    "guided_json": FieldRule(H, extension=True),
    "guided_regex": FieldRule(H, extension=True),
    "guided_choice": FieldRule(H, extension=True),
    "guided_grammar": FieldRule(R, extension=True),
    "structured_outputs": FieldRule(H, extension=True, note="json, regex, choice, json_object"),
    "length_penalty": FieldRule(R, extension=True),
    "use_beam_search": FieldRule(D, extension=True, default=False),
    "prompt_logprobs": FieldRule(R, extension=True),
    "allowed_token_ids": FieldRule(R, extension=True),
    "bad_words": FieldRule(R, extension=True),
    "truncate_prompt_tokens": FieldRule(R, extension=True),
    "spaces_between_special_tokens": FieldRule(D, extension=True, default=True),
    "chat_template": FieldRule(R, ONLY_CHAT, extension=True),
    "chat_template_kwargs": FieldRule(R, ONLY_CHAT, extension=True),
    "documents": FieldRule(R, ONLY_CHAT, extension=True),
    "priority": FieldRule(R, extension=True, note="scheduling is by tenant fair share"),
    "cache_salt": FieldRule(R, extension=True, note="the cache namespace is the tenant's"),
    "logits_processors": FieldRule(R, extension=True),
    "return_tokens_as_token_ids": FieldRule(R, extension=True),
}

# Keys inside object-valued fields, checked the same way.
NESTED: Mapping[str, Mapping[str, FieldRule]] = {
    "stream_options": {
        "include_usage": FieldRule(H),
        "include_obfuscation": FieldRule(N, note="chunks are not padded"),
        "continuous_usage_stats": FieldRule(H, extension=True, note="usage in every chunk"),
    },
    "structured_outputs": {
        "json": FieldRule(H, extension=True),
        "regex": FieldRule(H, extension=True),
        "choice": FieldRule(H, extension=True),
        "json_object": FieldRule(H, extension=True),
    },
}


def unsupported(message: str, param: str) -> ApiError:
    return bad_request(message, param=param, code="unsupported_parameter")


def check_fields(body: Mapping[str, Any], endpoint: str) -> None:
    """Refuse, naming it, the first field of ``body`` this server would not honour."""
    _check(body, FIELDS, endpoint, "")
    for name, rules in NESTED.items():
        value = body.get(name)
        if isinstance(value, dict):
            _check(value, rules, endpoint, f"{name}.")


def _check(body: Mapping[str, Any], rules: Mapping[str, FieldRule], endpoint: str, at: str) -> None:
    for name, value in body.items():
        param = at + name
        rule = rules.get(name)
        if rule is None or endpoint not in rule.endpoints:
            raise unsupported(f"Unrecognized request argument supplied: {param}", param)
        if value is None or rule.handling in (Handling.HONOURED, Handling.NO_EFFECT):
            continue
        if rule.handling is Handling.REFUSED:
            raise unsupported(f"`{param}` is not supported by this server.", param)
        if value != rule.default:
            raise unsupported(
                f"`{param}` is supported only at its default value, {rule.default!r}.", param
            )


def decode_request(body: bytes, type_: type[T], endpoint: str) -> T:
    """The body as ``type_`` once every field in it is known and honoured (else a 400)."""
    try:
        raw = msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        raise invalid_json() from exc
    except (UnicodeDecodeError, RecursionError) as exc:
        raise unreadable_json(exc) from exc
    if not isinstance(raw, dict):
        raise bad_request("The request body must be a JSON object.")
    check_fields(raw, endpoint)
    return decode_body(body, type_)
