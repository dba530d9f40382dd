"""Request decoding: unknown fields ignored, wrong types named, messages and sampling checked."""

from __future__ import annotations

import pytest

from engine.errors import InvalidRequestError
from web.openai.schemas import (
    MAX_N,
    ChatCompletionRequest,
    CompletionRequest,
    chat_messages,
    check_n,
    decode_body,
    sampling_params,
)
from web.ops.errors import ApiError


def decode_chat(body: bytes) -> ChatCompletionRequest:
    return decode_body(body, ChatCompletionRequest)


def test_unknown_fields_are_ignored() -> None:
    request = decode_chat(
        b'{"model":"m","messages":[{"role":"user","content":"hi","x":1}],"logit_bias":{}}'
    )
    assert request.messages[0].content == "hi"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b'{"model":"m","messages":[],"max_tokens":"5"}', "max_tokens"),
        (b'{"model":"m","messages":[],"max_tokens":1.5}', "max_tokens"),
        (b'{"model":"m","messages":[{"content":"x"}]}', "messages[0].role"),
        (b'{"messages":[]}', "model"),
        (b'{"model":"m","messages":[],"stream":"yes"}', "stream"),
        (b'{"model":"m","messages":[],"stream_options":{"include_usage":3}}', None),
    ],
)
def test_wrong_types_name_the_parameter(body: bytes, param: str | None) -> None:
    with pytest.raises(ApiError) as info:
        decode_chat(body)
    assert info.value.status_code == 400
    if param is not None:
        assert info.value.param == param


@pytest.mark.parametrize("body", [b"", b"{", b"[1,2]", b"null", b'"text"'])
def test_malformed_or_non_object_bodies_are_400(body: bytes) -> None:
    with pytest.raises(ApiError) as info:
        decode_chat(body)
    assert info.value.status_code == 400


def test_text_parts_are_joined_and_developer_is_a_system_message() -> None:
    request = decode_chat(
        b'{"model":"m","messages":[{"role":"developer","content":"be brief"},'
        b'{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}]}'
    )
    assert chat_messages(request) == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "ab"},
    ]


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        (b"[]", "messages"),
        (b'[{"role":"wizard","content":"x"}]', "messages[0].role"),
        (b'[{"role":"user","content":null}]', "messages[0].content"),
        (b'[{"role":"user","content":[{"type":"image_url"}]}]', "messages[0].content"),
    ],
)
def test_bad_messages_are_rejected(messages: bytes, param: str) -> None:
    request = decode_chat(b'{"model":"m","messages":' + messages + b"}")
    with pytest.raises(ApiError) as info:
        chat_messages(request)
    assert info.value.param == param


def test_n_is_between_one_and_the_limit() -> None:
    assert (check_n(None), check_n(1), check_n(MAX_N)) == (1, 1, MAX_N)
    for n in (0, -1, MAX_N + 1):
        with pytest.raises(ApiError) as info:
            check_n(n)
        assert info.value.param == "n"


def test_sampling_defaults_follow_openai() -> None:
    request = decode_body(b'{"model":"m","prompt":"x","stop":"END"}', CompletionRequest)
    params = sampling_params(request, 10)
    assert (params.temperature, params.top_p, params.stop, params.max_tokens) == (
        1.0,
        1.0,
        ("END",),
        10,
    )


@pytest.mark.parametrize(
    ("field", "value"), [("temperature", 2.5), ("top_p", 0.0), ("temperature", -1.0)]
)
def test_out_of_range_sampling_is_named(field: str, value: float) -> None:
    body = f'{{"model":"m","prompt":"x","{field}":{value}}}'.encode()
    params = sampling_params(decode_body(body, CompletionRequest), 10)
    with pytest.raises(InvalidRequestError) as info:
        params.validate()
    assert info.value.param == field


def test_ignore_eos_extension_reaches_the_sampling_params() -> None:
    body = b'{"model": "m", "prompt": "hi", "ignore_eos": true}'
    assert sampling_params(decode_body(body, CompletionRequest), 8).ignore_eos
    plain = b'{"model": "m", "prompt": "hi"}'
    assert not sampling_params(decode_body(plain, CompletionRequest), 8).ignore_eos
    with pytest.raises(ApiError):
        decode_body(b'{"model": "m", "prompt": "hi", "ignore_eos": "yes"}', CompletionRequest)
