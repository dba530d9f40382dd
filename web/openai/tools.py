"""Tools on chat completions: the definitions, ``tool_choice``, and the prompt that shows them.

- ``none``: the tools are not shown and the answer is text.
- ``auto`` (the default with tools): the tools are shown; the answer is text, tool calls, or
  both (calls are parsed from ``<tool_call>`` blocks, see ``web/openai/tool_calls.py``).
- ``required``: the answer is one call, grammar-constrained to
  ``{"name": <a tool>, "arguments": <its parameters>}``.
- a named function: the answer is that function's arguments, constrained to its parameters.

A chat template that takes a ``tools`` variable renders the definitions itself; otherwise a
system message (``FALLBACK_PROMPT``) lists them and asks for ``<tool_call>`` blocks. Assistant
messages with ``tool_calls`` and ``tool`` messages go back through the same template.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from engine.structured.spec import GrammarSpec
from web.ops.errors import bad_request

MAX_TOOLS = 128
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
FALLBACK_PROMPT = (
    "You can call functions. These are available, each with its parameters as JSON Schema:\n"
    "{tools}\n"
    "To call a function, answer with a JSON object inside <tool_call></tool_call> tags:\n"
    '<tool_call>\n{{"name": "<function name>", "arguments": {{<the arguments>}}}}\n</tool_call>\n'
    "Call several functions with several blocks. Otherwise answer in text."
)


class FunctionDef(msgspec.Struct, kw_only=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(msgspec.Struct, kw_only=True):
    type: str
    function: FunctionDef


class FunctionName(msgspec.Struct, kw_only=True):
    name: str


class NamedToolChoice(msgspec.Struct, kw_only=True):
    type: str
    function: FunctionName


class FunctionCall(msgspec.Struct, kw_only=True):
    name: str
    arguments: str


class ToolCall(msgspec.Struct, kw_only=True):
    id: str
    type: str = "function"
    function: FunctionCall


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """How one chat request uses its tools."""

    mode: Literal["auto", "required", "named"]
    tools: tuple[FunctionDef, ...]
    grammar: GrammarSpec | None  # required and named: the answer's grammar

    @property
    def names(self) -> frozenset[str]:
        return frozenset(tool.name for tool in self.tools)

    @property
    def named(self) -> str | None:
        return self.tools[0].name if self.mode == "named" else None


def plan_tools(
    tools: list[ToolDef] | None, choice: str | NamedToolChoice | None
) -> ToolPlan | None:
    """What ``tools`` and ``tool_choice`` ask for (None: answer in text); a 400 if malformed."""
    if not tools:
        if choice not in (None, "none"):
            raise bad_request("tool_choice needs tools.", "tool_choice")
        return None
    functions = _functions(tools)
    if choice is None or choice == "auto":
        return ToolPlan("auto", functions, None)
    if choice == "none":
        return None
    if choice == "required":
        cases = [
            {
                "type": "object",
                "properties": {"name": {"const": f.name}, "arguments": _parameters(f)},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for f in functions
        ]
        return ToolPlan("required", functions, GrammarSpec.json_schema({"anyOf": cases}))
    if isinstance(choice, NamedToolChoice):
        if choice.type != "function":
            raise bad_request("tool_choice.type must be function.", "tool_choice.type")
        chosen = [f for f in functions if f.name == choice.function.name]
        if not chosen:
            raise bad_request(
                f"tool_choice names {choice.function.name!r}, which is not among the tools.",
                "tool_choice.function.name",
            )
        return ToolPlan("named", tuple(chosen), GrammarSpec.json_schema(_parameters(chosen[0])))
    raise bad_request(
        "tool_choice must be none, auto, required or a named function.", "tool_choice"
    )


def _functions(tools: list[ToolDef]) -> tuple[FunctionDef, ...]:
    if len(tools) > MAX_TOOLS:
        raise bad_request(f"At most {MAX_TOOLS} tools.", "tools")
    seen: set[str] = set()
    for index, tool in enumerate(tools):
        if tool.type != "function":
            raise bad_request("Only tools of type function are supported.", f"tools[{index}].type")
        name = tool.function.name
        if not _NAME.match(name):
            raise bad_request(
                "A function name is 1 to 64 letters, digits, underscores or dashes.",
                f"tools[{index}].function.name",
            )
        if name in seen:
            raise bad_request(f"Two tools are named {name!r}.", f"tools[{index}].function.name")
        seen.add(name)
    return tuple(tool.function for tool in tools)


def _parameters(function: FunctionDef) -> dict[str, Any]:
    return function.parameters if function.parameters is not None else {"type": "object"}


def tool_definitions(plan: ToolPlan) -> list[dict[str, Any]]:
    """The tools as chat templates take them (OpenAI's shape)."""
    return [
        {
            "type": "function",
            "function": {
                "name": f.name,
                "description": f.description or "",
                "parameters": _parameters(f),
            },
        }
        for f in plan.tools
    ]


def template_takes_tools(template: str | None) -> bool:
    """Whether a chat template renders a ``tools`` variable."""
    return template is not None and re.search(r"\btools\b", template) is not None


def fallback_messages(
    messages: list[dict[str, Any]], plan: ToolPlan | None
) -> list[dict[str, Any]]:
    """Messages for a template without tool support: tool calls and results as text, and the
    tools in a system message of their own (joined to the first one when there is one)."""
    rendered = [_as_text(message) for message in messages]
    if plan is None:
        return rendered
    listing = "\n".join(
        json.dumps(
            {"name": f.name, "description": f.description or "", "parameters": _parameters(f)}
        )
        for f in plan.tools
    )
    prompt = FALLBACK_PROMPT.format(tools=listing)
    if rendered and rendered[0]["role"] == "system":
        first = dict(rendered[0])
        first["content"] = f"{first['content']}\n\n{prompt}"
        return [first, *rendered[1:]]
    return [{"role": "system", "content": prompt}, *rendered]


def _as_text(message: dict[str, Any]) -> dict[str, Any]:
    calls = message.get("tool_calls")
    if message["role"] == "assistant" and calls:
        blocks = [
            "<tool_call>\n"
            + json.dumps({"name": c["function"]["name"], "arguments": _parsed(c["function"])})
            + "\n</tool_call>"
            for c in calls
        ]
        content = "\n".join([message.get("content") or "", *blocks]).strip()
        return {"role": "assistant", "content": content}
    if message["role"] == "tool":
        return {"role": "tool", "content": message.get("content") or ""}
    return {"role": message["role"], "content": message.get("content") or ""}


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages for a template with tool support: arguments as objects where they parse."""
    rendered: list[dict[str, Any]] = []
    for message in messages:
        calls = message.get("tool_calls")
        if not calls:
            rendered.append(message)
            continue
        parsed = [
            {**c, "function": {**c["function"], "arguments": _parsed(c["function"])}} for c in calls
        ]
        rendered.append({**message, "tool_calls": parsed})
    return rendered


def _parsed(function: dict[str, Any]) -> Any:
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def prompt_token_ids(
    tokenizer: Any, messages: list[dict[str, Any]], plan: ToolPlan | None
) -> list[int]:
    """The chat prompt's token ids, with the tools shown as the template (or fallback) does."""
    if template_takes_tools(getattr(tokenizer, "chat_template", None)):
        tools = tool_definitions(plan) if plan is not None else None
        ids: list[int] = tokenizer.apply_chat_template(template_messages(messages), tools=tools)
        return ids
    fallback: list[int] = tokenizer.apply_chat_template(fallback_messages(messages, plan))
    return fallback


class DeltaFunction(msgspec.Struct, kw_only=True, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A piece of a streamed call: the first piece has its id, type and name."""

    index: int
    id: str | None = None
    type: str | None = None
    function: DeltaFunction
