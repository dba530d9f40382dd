"""Structured output and tools on a real `atrium serve` with the default model, through the
official openai client, streamed and not."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest

from tests.support.serve import Server, running_server

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 30},
        "country": {"type": "string", "maxLength": 30},
        "population_millions": {"type": "number"},
        "landmarks": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    },
    "required": ["city", "country", "population_millions", "landmarks"],
    "additionalProperties": False,
}
WEATHER: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 40},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ASK: Any = [{"role": "user", "content": "What is the weather in Paris today?"}]


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[openai.OpenAI, str]]:
    with running_server(tmp_path_factory.mktemp("serve")) as (srv, proc, log_path):
        api = Server.client(srv, srv.key_for("structured"))
        yield api, api.models.list().data[0].id
        proc.terminate()
        assert proc.wait(timeout=60) == 0, log_path.read_text()


def test_json_schema_streamed_and_not(client: tuple[openai.OpenAI, str]) -> None:
    api, model = client
    messages: Any = [{"role": "user", "content": "Describe Paris as JSON."}]
    response_format: Any = {
        "type": "json_schema",
        "json_schema": {"name": "city", "schema": CITY, "strict": True},
    }
    whole = api.chat.completions.create(
        model=model, messages=messages, response_format=response_format, max_tokens=120,
        temperature=0,
    )  # fmt: skip
    jsonschema.validate(json.loads(whole.choices[0].message.content or ""), CITY)
    chunks = api.chat.completions.create(
        model=model, messages=messages, response_format=response_format, max_tokens=120,
        temperature=0, stream=True,
    )  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content  # greedy: the same answer either way
    cut = api.chat.completions.create(
        model=model, messages=messages, response_format=response_format, max_tokens=40,
        temperature=0.9, seed=5,
    )  # fmt: skip
    jsonschema.validate(json.loads(cut.choices[0].message.content or ""), CITY)
    assert cut.choices[0].finish_reason in ("stop", "length")


def test_guided_choice_and_json_object(client: tuple[openai.OpenAI, str]) -> None:
    api, model = client
    messages: Any = [{"role": "user", "content": "Is the sky blue? Answer yes or no."}]
    answer = api.chat.completions.create(
        model=model, messages=messages, max_tokens=5, extra_body={"guided_choice": ["yes", "no"]}
    )
    assert answer.choices[0].message.content in ("yes", "no")
    obj = api.chat.completions.create(
        model=model, messages=messages, max_tokens=60, response_format={"type": "json_object"}
    )
    assert isinstance(json.loads(obj.choices[0].message.content or ""), dict)


def test_a_named_tool_call_and_its_answer(client: tuple[openai.OpenAI, str]) -> None:
    api, model = client
    choice: Any = {"type": "function", "function": {"name": "get_weather"}}
    answer = api.chat.completions.create(
        model=model, messages=ASK, tools=[WEATHER], tool_choice=choice, max_tokens=60,
        temperature=0,
    )  # fmt: skip
    assert answer.choices[0].finish_reason == "tool_calls"
    (call,) = answer.choices[0].message.tool_calls or []
    arguments = json.loads(call.function.arguments)  # type: ignore[union-attr]
    jsonschema.validate(arguments, WEATHER["function"]["parameters"])
    history: Any = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "21 degrees and sunny"},
    ]
    final = api.chat.completions.create(
        model=model, messages=history, tools=[WEATHER], tool_choice="none", max_tokens=30
    )
    assert final.choices[0].message.content
    assert not final.choices[0].message.tool_calls


def test_required_tool_call_streams_its_arguments(client: tuple[openai.OpenAI, str]) -> None:
    api, model = client
    chunks = list(
        api.chat.completions.create(
            model=model, messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=60,
            temperature=0, stream=True,
        )
    )  # fmt: skip
    pieces = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert pieces[0].id and pieces[0].function and pieces[0].function.name == "get_weather"
    assert len(pieces) > 2
    arguments = "".join((p.function.arguments or "") if p.function else "" for p in pieces)
    jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_auto_answers_with_text_or_well_formed_calls(client: tuple[openai.OpenAI, str]) -> None:
    api, model = client
    answer = api.chat.completions.create(
        model=model, messages=ASK, tools=[WEATHER], max_tokens=80, temperature=0
    )
    message = answer.choices[0].message
    for call in message.tool_calls or []:
        assert call.function.name == "get_weather"  # type: ignore[union-attr]
    if message.tool_calls:
        assert answer.choices[0].finish_reason in ("tool_calls", "length")
    else:
        assert message.content
