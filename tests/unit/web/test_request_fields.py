"""The field registry: every listed field is honoured, accepted, or refused by name; unknown
fields are refused; an honoured field is one the request structs actually read."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from web.openai.fields import (
    CHAT,
    COMPLETION,
    FIELDS,
    NESTED,
    FieldRule,
    Handling,
    check_fields,
    decode_request,
)
from web.openai.schemas import ChatCompletionRequest, CompletionRequest, StreamOptions
from web.ops.errors import ApiError

STRUCTS: dict[str, type[msgspec.Struct]] = {
    CHAT: ChatCompletionRequest,
    COMPLETION: CompletionRequest,
}
CASES = [
    (endpoint, name, rule) for name, rule in FIELDS.items() for endpoint in sorted(rule.endpoints)
]


def other_value(rule: FieldRule) -> object:
    """A value that is not the field's default (for DEFAULT_ONLY fields)."""
    if isinstance(rule.default, bool):
        return not rule.default
    if isinstance(rule.default, int):
        return rule.default + 1
    return ["audio"]


def refusal(body: dict[str, Any], endpoint: str) -> ApiError:
    with pytest.raises(ApiError) as info:
        check_fields(body, endpoint)
    assert info.value.status_code == 400
    assert info.value.code == "unsupported_parameter"
    return info.value


@pytest.mark.parametrize(("endpoint", "name", "rule"), CASES, ids=[f"{e}-{n}" for e, n, _ in CASES])
def test_each_field_is_handled_as_listed(endpoint: str, name: str, rule: FieldRule) -> None:
    check_fields({name: None}, endpoint)  # null means unset, whatever the field
    if rule.handling is Handling.REFUSED:
        error = refusal({name: "anything"}, endpoint)
        assert error.param == name and name in error.message
    elif rule.handling is Handling.DEFAULT_ONLY:
        check_fields({name: rule.default}, endpoint)
        assert refusal({name: other_value(rule)}, endpoint).param == name
    else:
        check_fields({name: "any value"}, endpoint)
    if rule.handling is Handling.HONOURED:  # read by the request struct, so never dropped
        assert name in STRUCTS[endpoint].__struct_fields__


@pytest.mark.parametrize("endpoint", [CHAT, COMPLETION])
def test_every_struct_field_is_listed(endpoint: str) -> None:
    for name in STRUCTS[endpoint].__struct_fields__:
        rule = FIELDS.get(name)
        assert rule is not None and endpoint in rule.endpoints, name
        assert rule.handling in (Handling.HONOURED, Handling.NO_EFFECT), name
    for name in StreamOptions.__struct_fields__:
        assert NESTED["stream_options"][name].handling is Handling.HONOURED


@pytest.mark.parametrize(
    ("endpoint", "body", "param"),
    [
        (CHAT, {"frobnicate": 1}, "frobnicate"),
        (COMPLETION, {"frobnicate": 1}, "frobnicate"),
        (COMPLETION, {"messages": []}, "messages"),  # a chat field on completions
        (CHAT, {"prompt": "x"}, "prompt"),
        (CHAT, {"echo": True}, "echo"),
        (CHAT, {"stream_options": {"include_usage": True, "flush": 1}}, "stream_options.flush"),
    ],
)
def test_unknown_or_misplaced_fields_are_refused_by_name(
    endpoint: str, body: dict[str, Any], param: str
) -> None:
    error = refusal(body, endpoint)
    assert error.param == param
    assert "Unrecognized request argument" in error.message


def test_fields_without_effect_are_accepted_together() -> None:
    body = {"user": "u", "metadata": {"k": "v"}, "store": False, "service_tier": "auto",
            "safety_identifier": "s", "stream_options": {"include_obfuscation": False}}  # fmt: skip
    check_fields(body, CHAT)


def test_decode_request_checks_then_types() -> None:
    good = b'{"model":"m","prompt":[1,2,3],"logprobs":2,"echo":true,"user":"u"}'
    request = decode_request(good, CompletionRequest, COMPLETION)
    assert request.prompt == [1, 2, 3] and request.logprobs == 2
    with pytest.raises(ApiError) as info:
        decode_request(b'{"model":"m","prompt":"x","suffix":"y"}', CompletionRequest, COMPLETION)
    assert info.value.param == "suffix"
    with pytest.raises(ApiError) as info:
        decode_request(b'{"model":"m","prompt":"x","logprobs":"2"}', CompletionRequest, COMPLETION)
    assert info.value.param == "logprobs" and info.value.code == "invalid_request"
    with pytest.raises(ApiError) as info:
        decode_request(b"[1]", CompletionRequest, COMPLETION)
    assert info.value.status_code == 400
