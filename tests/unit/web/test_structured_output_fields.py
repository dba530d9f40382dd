"""response_format, guided_* and structured_outputs as one grammar, with 400s for bad ones."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import msgspec
import pytest

from engine.errors import InvalidRequestError
from engine.structured.spec import GrammarSpec
from web.openai.structured_output import (
    JsonSchemaFormat,
    ResponseFormat,
    StructuredOutputs,
    checked_grammar,
    requested_grammar,
)
from web.ops.errors import ApiError

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


class Body(msgspec.Struct, kw_only=True):
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    structured_outputs: StructuredOutputs | None = None


def schema_format(schema: dict[str, Any], strict: bool | None = None) -> ResponseFormat:
    return ResponseFormat(
        type="json_schema", json_schema=JsonSchemaFormat(name="x", schema=schema, strict=strict)
    )


@pytest.mark.parametrize(
    ("body", "spec", "param"),
    [
        (Body(response_format=ResponseFormat(type="json_object")), GrammarSpec("json"),
         "response_format"),
        (Body(response_format=schema_format(SCHEMA, strict=True)),
         GrammarSpec.json_schema(SCHEMA), "response_format"),
        (Body(guided_json=SCHEMA), GrammarSpec.json_schema(SCHEMA), "guided_json"),
        (Body(guided_json=json.dumps(SCHEMA)), GrammarSpec.json_schema(SCHEMA), "guided_json"),
        (Body(guided_regex="[0-9]+"), GrammarSpec("regex", "[0-9]+"), "guided_regex"),
        (Body(guided_choice=["a", "b"]), GrammarSpec.choice(["a", "b"]), "guided_choice"),
        (Body(structured_outputs=StructuredOutputs(choice=["x"])), GrammarSpec.choice(["x"]),
         "structured_outputs.choice"),
        (Body(structured_outputs=StructuredOutputs(json_object=True)), GrammarSpec("json"),
         "structured_outputs.json_object"),
    ],
)  # fmt: skip
def test_each_field_becomes_its_grammar(body: Body, spec: GrammarSpec, param: str) -> None:
    assert requested_grammar(body) == (spec, param)


def test_text_and_nothing_ask_for_no_grammar() -> None:
    assert requested_grammar(Body()) is None
    assert requested_grammar(Body(response_format=ResponseFormat(type="text"))) is None


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        (Body(response_format=ResponseFormat(type="yaml")), "response_format.type", "one of"),
        (Body(response_format=ResponseFormat(type="json_schema")), "response_format.json_schema",
         "needs json_schema.schema"),
        (Body(guided_json="{not json"), "guided_json", "not valid JSON"),
        (Body(guided_json="[1, 2]"), "guided_json", "must be a JSON schema"),
        (Body(guided_regex="[0-9]+", guided_choice=["a"]), "guided_choice", "Only one"),
    ],
)  # fmt: skip
def test_malformed_requests_are_400s_naming_the_field(body: Body, param: str, message: str) -> None:
    with pytest.raises(ApiError, match=message) as info:
        requested_grammar(body)
    assert info.value.status_code == 400
    assert info.value.param == param


def test_a_schema_or_pattern_the_grammar_cannot_take_is_refused_before_admission() -> None:
    with pytest.raises(InvalidRequestError, match="not a usable grammar") as info:
        asyncio.run(checked_grammar(Body(response_format=schema_format({"type": "nope"}))))
    assert info.value.param == "response_format"
    with pytest.raises(InvalidRequestError) as regex:
        asyncio.run(checked_grammar(Body(guided_regex="(unclosed")))
    assert regex.value.param == "guided_regex"
    assert asyncio.run(checked_grammar(Body(guided_json=SCHEMA))) == GrammarSpec.json_schema(SCHEMA)
