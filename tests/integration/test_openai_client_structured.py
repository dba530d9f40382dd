"""The official openai client against the gateway on the real engine (tiny random model):
response_format, vLLM's guided fields, and tools, streamed and not.

The tiny model's free text is noise: every valid JSON answer here is the grammar's doing.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from litestar.testing import TestClient

from tests.integration.gateway_fakes import settings
from web.app import create_app
from web.tenancy.principal import InMemoryTenancy, InMemoryTenant

KEY = "sk-structured"  # a tenant without a prompt limit: tool prompts are long in bytes
MESSAGES: Any = [{"role": "user", "content": "Describe a person."}]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
WEATHER: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"enum": ["c", "f"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CLOCK: Any = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
}


class Gateway:
    def __init__(self, http: TestClient) -> None:  # type: ignore[type-arg]
        self.http = http
        self.client = openai.OpenAI(
            base_url="http://testserver/v1", api_key=KEY, http_client=http, max_retries=0
        )
        self.model = self.client.models.list().data[0].id

    def chat(self, **args: Any) -> Any:
        args.setdefault("messages", MESSAGES)
        return self.client.chat.completions.create(model=self.model, **args)

    def chat_stream(self, **args: Any) -> list[Any]:
        return list(self.chat(stream=True, **args))


@pytest.fixture(scope="module")
def gw(tiny_llama_dir: Path) -> Iterator[Gateway]:
    config = settings(
        model=str(tiny_llama_dir), dtype="float32", device="cpu", kv_cache_bytes=8 * 2**20,
        speculative_tokens=4, engine_process=False,
    )  # fmt: skip
    tenancy = InMemoryTenancy()
    tenancy.add_key(KEY, InMemoryTenant("tenant-structured"))
    app = create_app(config, store=tenancy, include_admin=False)
    with TestClient(app) as http:
        yield Gateway(http)


def streamed_text(chunks: list[Any]) -> tuple[str, str | None]:
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasons = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    return text, reasons[-1] if reasons else None


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_answers_validate(gw: Gateway, stream: bool) -> None:
    response_format: Any = {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": PERSON, "strict": True},
    }
    for max_tokens, temperature in [(200, 0.0), (200, 1.0), (45, 1.0)]:
        args = {"response_format": response_format, "max_tokens": max_tokens,
                "temperature": temperature, "seed": 7}  # fmt: skip
        if stream:
            text, reason = streamed_text(gw.chat_stream(**args))
        else:
            answer = gw.chat(**args)
            text, reason = answer.choices[0].message.content, answer.choices[0].finish_reason
        jsonschema.validate(json.loads(text), PERSON)
        assert reason in ("stop", "length")


def test_json_object_and_n_choices(gw: Gateway) -> None:
    answer = gw.chat(response_format={"type": "json_object"}, max_tokens=40, n=3, seed=1)
    assert len(answer.choices) == 3
    for choice in answer.choices:
        assert isinstance(json.loads(choice.message.content), dict)


def test_guided_fields_through_extra_body(gw: Gateway) -> None:
    regex = gw.chat(max_tokens=20, extra_body={"guided_regex": "[A-F]{4}-[0-9]{2}"})
    assert re.fullmatch("[A-F]{4}-[0-9]{2}", regex.choices[0].message.content)
    assert regex.choices[0].finish_reason == "stop"
    choice = gw.chat(max_tokens=10, temperature=1.0, extra_body={"guided_choice": ["red", "blue"]})
    assert choice.choices[0].message.content in ("red", "blue")
    guided = gw.chat(max_tokens=200, extra_body={"guided_json": PERSON})
    jsonschema.validate(json.loads(guided.choices[0].message.content), PERSON)
    nested = gw.chat(max_tokens=8, extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert nested.choices[0].message.content in ("yes", "no")
    text = gw.client.completions.create(
        model=gw.model, prompt="Digits:", max_tokens=12, extra_body={"guided_regex": "[0-9]{5}"}
    )
    assert re.fullmatch("[0-9]{5}", text.choices[0].text)


def test_a_named_function_is_called_with_valid_arguments(gw: Gateway) -> None:
    choice: Any = {"type": "function", "function": {"name": "get_weather"}}
    answer = gw.chat(tools=[WEATHER, CLOCK], tool_choice=choice, max_tokens=60, temperature=1.0,
                     seed=1)  # fmt: skip
    message = answer.choices[0].message
    assert answer.choices[0].finish_reason == "tool_calls"
    assert message.content is None
    (call,) = message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


def test_required_streams_a_call_with_its_arguments_in_pieces(gw: Gateway) -> None:
    # A seed whose call ends within max_tokens on the tiny random model (get_time takes any object).
    chunks = gw.chat_stream(tools=[WEATHER, CLOCK], tool_choice="required", max_tokens=80, seed=1,
                            temperature=1.0)  # fmt: skip
    pieces = [
        c.choices[0].delta.tool_calls for c in chunks if c.choices and c.choices[0].delta.tool_calls
    ]
    assert len(pieces) > 2  # the name first, then arguments as they are generated
    head = pieces[0][0]
    assert head.index == 0 and head.id.startswith("call_") and head.type == "function"
    name = head.function.name
    assert name in ("get_weather", "get_time")
    arguments = "".join(p.function.arguments or "" for piece in pieces for p in piece)
    schema = (
        WEATHER["function"]["parameters"]
        if name == "get_weather"
        else CLOCK["function"]["parameters"]
    )
    jsonschema.validate(json.loads(arguments), schema)
    assert all(p.id is None for piece in pieces[1:] for p in piece)
    assert streamed_text(chunks) == ("", "tool_calls")
    whole = gw.chat(
        tools=[WEATHER, CLOCK], tool_choice="required", max_tokens=80, seed=1, temperature=1.0
    )
    (call,) = whole.choices[0].message.tool_calls
    assert (call.function.name, call.function.arguments) == (name, arguments)


def test_tool_history_and_auto_render_through_the_fallback_prompt(gw: Gateway) -> None:
    plain = gw.chat(max_tokens=1, temperature=0.0)
    with_tools = gw.chat(tools=[WEATHER], max_tokens=1, temperature=0.0)
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + 50  # the tools are shown
    history: Any = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "3 C, snow"},
    ]  # fmt: skip
    answer = gw.chat(messages=history, tools=[WEATHER], max_tokens=4, temperature=0.0)
    assert answer.usage.prompt_tokens > with_tools.usage.prompt_tokens
    none = gw.chat(tools=[WEATHER], tool_choice="none", max_tokens=1, temperature=0.0)
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens


BAD_SCHEMA: Any = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no"}}}
NO_SUCH_TOOL: Any = {"type": "function", "function": {"name": "nope"}}
GRAMMAR = 'root ::= "a"'


@pytest.mark.parametrize(
    ("args", "param"),
    [
        ({"response_format": BAD_SCHEMA}, "response_format"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"extra_body": {"guided_regex": "(", "guided_choice": ["a"]}}, "guided_choice"),
        ({"extra_body": {"guided_regex": "("}}, "guided_regex"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": NO_SUCH_TOOL}, "tool_choice.function.name"),
        (
            {
                "tools": [WEATHER],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "tool_choice",
        ),
        (
            {"extra_body": {"guided_regex": "[0-9]", "ignore_eos": True}},
            "ignore_eos",
        ),
        ({"extra_body": {"guided_grammar": GRAMMAR}}, "guided_grammar"),
        ({"extra_body": {"guided_regex": "[0-9]", "min_tokens": 2}}, "min_tokens"),
        ({"extra_body": {"guided_json": PERSON}}, "max_tokens"),  # no answer fits in 5 tokens
        (
            {"extra_body": {"structured_outputs": {"grammar": GRAMMAR}}},
            "structured_outputs.grammar",
        ),
    ],
)
def test_bad_structured_requests_are_400s_naming_the_field(
    gw: Gateway, args: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        gw.chat(max_tokens=5, **args)
    assert info.value.status_code == 400
    assert info.value.body["param"] == param  # type: ignore[index]
