"""Structured output and tools on the chat route: from the request to the prompt and grammar,
and from generated text to the message (or stream deltas) with its tool calls."""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
from typing import Any

from engine.sampling_params import SamplingParams
from engine.structured.spec import GrammarSpec
from web.openai.generation import GenerationService
from web.openai.schemas import AssistantMessage, ChatCompletionRequest, Delta
from web.openai.structured_output import GrammarLimits, checked_grammar
from web.openai.tool_calls import Parsed, ToolCallParser, parse_all
from web.openai.tools import DeltaFunction, DeltaToolCall, ToolPlan, plan_tools, prompt_token_ids
from web.ops.errors import bad_request


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


async def chat_plan(body: ChatCompletionRequest) -> tuple[ToolPlan | None, GrammarSpec | None]:
    """The request's tool plan and the grammar its answer must follow (400s if malformed)."""
    plan = plan_tools(body.tools, body.tool_choice)
    spec = await checked_grammar(body)
    if plan is not None and plan.grammar is not None:
        if spec is not None:
            raise bad_request(
                "A structured output cannot be combined with tool_choice required or a named "
                "function: the call's arguments are already constrained.",
                "tool_choice",
            )
        spec = plan.grammar
        await asyncio.to_thread(spec.check, "tools")
    return plan, spec


async def chat_prompt(
    tokenizer: Any, messages: list[dict[str, Any]], plan: ToolPlan | None
) -> list[int]:
    """The prompt's token ids with the tools shown (off the event loop)."""
    return await asyncio.to_thread(prompt_token_ids, tokenizer, messages, plan)


def constrained(params: SamplingParams, spec: GrammarSpec | None) -> SamplingParams:
    """``params`` with the grammar; ``min_tokens`` would fight it (the grammar says where the
    answer ends), so the two together are a 400."""
    if spec is None:
        return params
    if params.min_tokens > 0:
        raise bad_request(
            "min_tokens cannot be combined with structured output or required tool calls.",
            "min_tokens",
        )
    return dataclasses.replace(params, grammar=spec)


def finish_reason_of(reason: str | None, num_calls: int) -> str | None:
    """A complete answer that calls tools finishes as "tool_calls", as OpenAI's do."""
    return "tool_calls" if num_calls and reason == "stop" else reason


def chat_message(
    plan: ToolPlan | None, text: str, reason: str | None
) -> tuple[AssistantMessage, str | None]:
    """The whole answer as a message (its calls parsed out) and its finish reason."""
    if plan is None:
        return AssistantMessage(role="assistant", content=text), reason
    content, calls = parse_all(plan, text, new_call_id)
    if not calls:
        return AssistantMessage(role="assistant", content=content), reason
    message = AssistantMessage(role="assistant", content=content.strip() or None, tool_calls=calls)
    return message, finish_reason_of(reason, len(calls))


class ChatStreamTools:
    """Per choice, turns streamed text into content and ``tool_calls`` deltas."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self._parsers: dict[int, ToolCallParser] = {}

    def _parser(self, index: int) -> ToolCallParser:
        parser = self._parsers.get(index)
        if parser is None:
            parser = self._parsers[index] = ToolCallParser(self.plan, new_call_id)
        return parser

    def feed(self, index: int, text: str) -> list[Delta]:
        return _deltas(self._parser(index).feed(text))

    def finish(self, index: int, reason: str | None) -> tuple[list[Delta], str | None]:
        parser = self._parser(index)
        deltas = _deltas(parser.finish())
        return deltas, finish_reason_of(reason, parser.num_calls)


def _deltas(parsed: Parsed) -> list[Delta]:
    deltas: list[Delta] = []
    if parsed.content:
        deltas.append(Delta(content=parsed.content))
    if parsed.calls:
        calls = [
            DeltaToolCall(
                index=call.index,
                id=call.id,
                type="function" if call.id else None,
                function=DeltaFunction(name=call.name, arguments=call.arguments),
            )
            for call in collect_pieces(parsed)
        ]
        deltas.append(Delta(tool_calls=calls))
    return deltas


def collect_pieces(parsed: Parsed) -> list[Any]:
    """Consecutive pieces of one call sent as one (a step may produce several)."""
    merged: list[Any] = []
    for call in parsed.calls:
        last = merged[-1] if merged else None
        if last is not None and last.index == call.index and call.id is None:
            last.arguments += call.arguments
        else:
            merged.append(dataclasses.replace(call))
    return merged


async def check_fits(
    service: GenerationService, spec: GrammarSpec | None, max_tokens: int, param: str
) -> None:
    """A 400 when ``max_tokens`` is below the shortest answer ``spec`` allows."""
    if spec is None or max_tokens <= 0:  # a non-positive max_tokens is refused on its own
        return
    runtime = service.runtime  # each served model has its own tokenizer
    limits = service.grammar_limits.get(runtime.name)
    if limits is None:
        limits = service.grammar_limits[runtime.name] = GrammarLimits(runtime.tokenizer)
    await limits.check_fits(spec, max_tokens, param)
