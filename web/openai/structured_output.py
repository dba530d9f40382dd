"""Structured output on the OpenAI routes: ``response_format`` and vLLM's ``guided_*`` and
``structured_outputs`` fields, turned into the one ``GrammarSpec`` the engine enforces.

``json_object`` gives any JSON object; ``json_schema`` a value of the schema (``strict`` or not,
the schema is always enforced); ``guided_regex`` text matching the pattern; ``guided_choice`` one
of the strings. A request sets at most one of them. The grammar is parsed here, so a bad schema
or pattern is a 400 before anything is admitted.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import xgrammar

from engine.structured.closing import completion
from engine.structured.compiler import GrammarCompiler
from engine.structured.spec import GrammarSpec
from web.ops.errors import bad_request

FORMAT_TYPES = ("text", "json_object", "json_schema")
MAX_REMEMBERED = 256  # grammars whose shortest answer is remembered


class JsonSchemaFormat(msgspec.Struct, kw_only=True):
    name: str | None = None
    description: str | None = None
    schema: dict[str, Any] | bool | None = None
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, kw_only=True):
    type: str
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's ``structured_outputs``: one of these keys."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    json_object: bool | None = None


def requested_grammar(body: Any) -> tuple[GrammarSpec, str] | None:
    """The grammar a request body asks for and the field that asked, or None."""
    found: list[tuple[GrammarSpec, str]] = []
    response_format: ResponseFormat | None = getattr(body, "response_format", None)
    if response_format is not None:
        spec = _format_spec(response_format)
        if spec is not None:
            found.append((spec, "response_format"))
    guided_json = getattr(body, "guided_json", None)
    if guided_json is not None:
        found.append((_schema_spec(guided_json, "guided_json"), "guided_json"))
    guided_regex = getattr(body, "guided_regex", None)
    if guided_regex is not None:
        found.append((GrammarSpec("regex", guided_regex), "guided_regex"))
    guided_choice = getattr(body, "guided_choice", None)
    if guided_choice is not None:
        found.append((GrammarSpec.choice(guided_choice), "guided_choice"))
    outputs: StructuredOutputs | None = getattr(body, "structured_outputs", None)
    if outputs is not None:
        found.extend(_structured_outputs(outputs))
    if len(found) > 1:
        names = ", ".join(param for _, param in found)
        raise bad_request(f"Only one structured output may be asked for; got {names}.", found[1][1])
    return found[0] if found else None


async def checked_grammar(body: Any) -> GrammarSpec | None:
    """``requested_grammar``, parsed off the event loop (a 400 naming the field if it fails)."""
    requested = requested_grammar(body)
    if requested is None:
        return None
    spec, param = requested
    await asyncio.to_thread(spec.check, param)
    return spec


def _format_spec(response_format: ResponseFormat) -> GrammarSpec | None:
    kind = response_format.type
    if kind not in FORMAT_TYPES:
        raise bad_request(
            f"response_format.type must be one of {', '.join(FORMAT_TYPES)}; got {kind!r}.",
            "response_format.type",
        )
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json")
    form = response_format.json_schema
    if form is None or form.schema is None:
        raise bad_request(
            "response_format of type json_schema needs json_schema.schema.",
            "response_format.json_schema",
        )
    return _schema_spec(form.schema, "response_format.json_schema.schema")


def _schema_spec(schema: dict[str, Any] | str | bool, param: str) -> GrammarSpec:
    if isinstance(schema, str):  # vLLM takes a schema as JSON text too
        try:
            schema = msgspec.json.decode(schema)
        except msgspec.DecodeError as exc:
            raise bad_request(f"{param} is not valid JSON: {exc}", param) from exc
    if not isinstance(schema, dict | bool):
        raise bad_request(f"{param} must be a JSON schema (an object).", param)
    return GrammarSpec.json_schema(schema)


def _structured_outputs(outputs: StructuredOutputs) -> list[tuple[GrammarSpec, str]]:
    found: list[tuple[GrammarSpec, str]] = []
    if outputs.json is not None:
        param = "structured_outputs.json"
        found.append((_schema_spec(outputs.json, param), param))
    if outputs.regex is not None:
        found.append((GrammarSpec("regex", outputs.regex), "structured_outputs.regex"))
    if outputs.choice is not None:
        found.append((GrammarSpec.choice(outputs.choice), "structured_outputs.choice"))
    if outputs.json_object:
        found.append((GrammarSpec("json"), "structured_outputs.json_object"))
    return found


class GrammarLimits:
    """The fewest tokens an answer under a grammar takes (its shortest completion from the
    start, tokenized), so that a ``max_tokens`` too small for any valid answer is a 400."""

    def __init__(self, tokenizer: Any) -> None:
        hf = tokenizer.hf
        stop_ids = tuple(getattr(tokenizer, "eos_token_ids", ()))
        self._compiler = GrammarCompiler(hf, len(hf), stop_ids)
        self._shortest: dict[GrammarSpec, int | None] = {}

    def shortest(self, spec: GrammarSpec) -> int | None:
        """Blocking (compiles on first use); None when no completion is found."""
        if spec not in self._shortest:
            matcher = xgrammar.GrammarMatcher(self._compiler.compile(spec).result())
            table = self._compiler.table
            text = None if table is None else completion(matcher, table)
            token_ids = None if text is None or table is None else table.tokens_for(matcher, text)
            if len(self._shortest) >= MAX_REMEMBERED:
                self._shortest.pop(next(iter(self._shortest)))
            self._shortest[spec] = None if token_ids is None else len(token_ids)
        return self._shortest[spec]

    async def check_fits(self, spec: GrammarSpec | None, max_tokens: int, param: str) -> None:
        """A 400 naming ``param`` when no answer under ``spec`` fits in ``max_tokens``."""
        if spec is None:
            return
        shortest = await asyncio.to_thread(self.shortest, spec)
        if shortest is not None and shortest > max_tokens:
            raise bad_request(
                f"{param} is {max_tokens}, but the shortest answer the requested format allows "
                f"takes {shortest} tokens.",
                param,
            )
