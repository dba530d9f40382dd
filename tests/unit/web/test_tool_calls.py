"""Tool definitions, tool_choice and parsing calls out of streamed text."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from web.openai.tool_calls import CallDelta, ToolCallParser, collect_calls, parse_all
from web.openai.tools import (
    FunctionDef,
    FunctionName,
    NamedToolChoice,
    ToolDef,
    ToolPlan,
    fallback_messages,
    plan_tools,
    template_takes_tools,
)
from web.ops.errors import ApiError

WEATHER = ToolDef(
    type="function",
    function=FunctionDef(
        name="get_weather",
        description="Weather in a city",
        parameters={
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
        },
    ),
)
TIME = ToolDef(type="function", function=FunctionDef(name="get_time"))
CALL = '{"name": "get_weather", "arguments": {"city": "Paris \\"centre\\"", "unit": "c"}}'
ARGS = '{"city": "Paris \\"centre\\"", "unit": "c"}'


def plan(choice: str | NamedToolChoice | None = None) -> ToolPlan:
    result = plan_tools([WEATHER, TIME], choice)
    assert result is not None
    return result


def streamed(plan_: ToolPlan, pieces: list[str]) -> tuple[str, list[CallDelta], int]:
    counter = itertools.count()
    parser = ToolCallParser(plan_, lambda: f"call_{next(counter)}")
    content = ""
    deltas: list[CallDelta] = []
    for piece in pieces:
        parsed = parser.feed(piece)
        content += parsed.content
        deltas.extend(parsed.calls)
    rest = parser.finish()
    content += rest.content
    deltas.extend(rest.calls)
    return content, deltas, parser.num_calls


def test_required_streams_the_name_first_then_the_arguments_in_pieces() -> None:
    content, deltas, num_calls = streamed(plan("required"), list(CALL))
    assert content == ""
    assert num_calls == 1
    first = deltas[0]
    assert (first.index, first.id, first.name) == (0, "call_0", "get_weather")
    assert len(deltas) > 10  # arguments come as they are generated
    (call,) = collect_calls(deltas)
    assert json.loads(call.function.arguments) == {"city": 'Paris "centre"', "unit": "c"}
    assert call.function.arguments == ARGS


def test_a_named_function_streams_the_whole_answer_as_its_arguments() -> None:
    chosen = NamedToolChoice(type="function", function=FunctionName(name="get_weather"))
    content, deltas, num_calls = streamed(plan(chosen), ["", '{"city"', ': "Oslo"}'])
    (call,) = collect_calls(deltas)
    assert (content, num_calls, call.function.name) == ("", 1, "get_weather")
    assert call.function.arguments == '{"city": "Oslo"}'


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        (f"Let me check.\n<tool_call>\n{CALL}\n</tool_call>", "Let me check.\n", [ARGS]),
        (f"<tool_call>{CALL}</tool_call><tool_call>{CALL}</tool_call>", "", [ARGS, ARGS]),
        (f"  {CALL}", "", [ARGS]),  # the whole answer is one call (Llama 3 style)
        ('{"name": "get_weather", "parameters": {"city": "Rome"}}', "", ['{"city": "Rome"}']),
        ('{"arguments": {"city": "Rome"}, "name": "get_weather"}', "", ['{"city": "Rome"}']),
        ('<tool_call>{"name": "launch", "arguments": {}}</tool_call>',
         '<tool_call>{"name": "launch", "arguments": {}}</tool_call>', []),
        ('{"answer": 42}', '{"answer": 42}', []),
        ("a < b, and <tool_ is no tag", "a < b, and <tool_ is no tag", []),
        (f"<tool_call>{CALL}", "", [ARGS]),  # cut before its closing tag
        ('<tool_call>{"name": "get_time", "arguments": "{}"}</tool_call>', "", ["{}"]),
    ],
)  # fmt: skip
def test_auto_finds_calls_in_blocks_or_as_the_whole_answer(
    text: str, content: str, calls: list[str]
) -> None:
    got_content, got_calls = parse_all(plan(), text, lambda: "call_x")
    assert got_content == content
    assert [c.function.arguments for c in got_calls] == calls
    assert all(c.function.name in ("get_weather", "get_time") for c in got_calls)
    assert [c.id for c in got_calls] == ["call_x"] * len(calls)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=120), max_size=12), st.sampled_from([0, 1, 2]))
def test_any_split_of_the_stream_gives_the_whole_answer(cuts: list[int], which: int) -> None:
    text = [
        f"Checking.<tool_call>\n{CALL}\n</tool_call> and <tool_call>{CALL}</tool_call>",
        CALL,
        "no <tool_call  here",
    ][which]
    mode = plan("required") if which == 1 else plan()
    bounds = sorted({0, len(text), *(c for c in cuts if c < len(text))})
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
    content, deltas, num_calls = streamed(mode, pieces)
    whole_content, whole_calls = parse_all(mode, text, lambda: "call_0")
    assert content == whole_content
    got = collect_calls(deltas)
    assert [c.function.arguments for c in got] == [c.function.arguments for c in whole_calls]
    assert num_calls == len(got)


def test_tool_choice_is_checked() -> None:
    with pytest.raises(ApiError, match="needs tools"):
        plan_tools(None, "required")
    assert plan_tools(None, "none") is None
    assert plan_tools([WEATHER], "none") is None
    unknown = NamedToolChoice(type="function", function=FunctionName(name="nope"))
    with pytest.raises(ApiError, match="not among the tools"):
        plan_tools([WEATHER], unknown)
    with pytest.raises(ApiError, match="none, auto, required"):
        plan_tools([WEATHER], "sometimes")
    bad = ToolDef(type="function", function=FunctionDef(name="has space"))
    with pytest.raises(ApiError, match="function name"):
        plan_tools([bad], None)
    with pytest.raises(ApiError, match="Two tools"):
        plan_tools([WEATHER, WEATHER], None)
    with pytest.raises(ApiError, match="type function"):
        plan_tools([ToolDef(type="retrieval", function=FunctionDef(name="x"))], None)


def test_required_and_named_grammars_describe_the_call() -> None:
    required = plan("required").grammar
    assert required is not None
    schema = json.loads(required.value)
    assert [case["properties"]["name"]["const"] for case in schema["anyOf"]] == [
        "get_weather",
        "get_time",
    ]
    assert schema["anyOf"][1]["properties"]["arguments"] == {"type": "object"}
    chosen = NamedToolChoice(type="function", function=FunctionName(name="get_weather"))
    named = plan(chosen).grammar
    assert named is not None and json.loads(named.value) == WEATHER.function.parameters


def test_a_template_without_tools_gets_them_in_a_system_message() -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "18 C"},
    ]  # fmt: skip
    rendered = fallback_messages(messages, plan())
    assert rendered[0]["content"].startswith("Be brief.\n\nYou can call functions.")
    assert '"name": "get_weather"' in rendered[0]["content"]
    assert rendered[2] == {
        "role": "assistant",
        "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        "</tool_call>",
    }
    assert rendered[3] == {"role": "tool", "content": "18 C"}
    assert fallback_messages(messages[1:2], plan())[0]["role"] == "system"
    assert not template_takes_tools("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert template_takes_tools("{% if tools %}{{ tools | tojson }}{% endif %}")
