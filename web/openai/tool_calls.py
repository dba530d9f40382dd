"""Tool calls parsed out of generated text, incrementally, as OpenAI streams them.

A call is the object ``{"name": ..., "arguments": {...}}`` (``parameters`` is taken for
``arguments``, as Llama 3 writes it). Under ``auto`` calls come in ``<tool_call>`` blocks amid
text, or as the whole answer when it is one such object; under ``required`` the whole answer is
one call; under a named function the whole answer is its arguments. Once a call's name is read
its arguments stream in pieces as they are generated; a call whose name comes after its
arguments, or that does not parse while it streams, is parsed whole at its end. A block that
does not hold a call of a known tool stays text.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from web.openai.tools import FunctionCall, ToolCall, ToolPlan

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_HEAD = re.compile(
    r'^\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*'
)
_FIRST_KEY = re.compile(r'^\s*\{\s*"([^"]*)"')
MAX_HEAD = 512  # characters read for a call's name before it is parsed whole instead


@dataclass(slots=True)
class CallDelta:
    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(slots=True)
class Parsed:
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def add(self, other: Parsed) -> None:
        self.content += other.content
        self.calls.extend(other.calls)


class _CallScanner:
    """One call object, fed in pieces: the name as soon as it is known, then the arguments."""

    def __init__(self, index: int, call_id: str, names: frozenset[str]) -> None:
        self.index = index
        self.call_id = call_id
        self.names = names
        self.buffer = ""
        self.phase = "head"  # head -> args -> done; or whole (parsed at the end)
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.started = False

    def feed(self, text: str) -> list[CallDelta]:
        if self.phase in ("whole", "done"):
            self.buffer += text
            return []
        if self.phase == "args":
            return self._arguments(text)
        self.buffer += text
        match = _HEAD.match(self.buffer)
        if match is None:
            first_key = _FIRST_KEY.match(self.buffer)
            if len(self.buffer) > MAX_HEAD or (first_key and first_key.group(1) != "name"):
                self.phase = "whole"
            return []
        name = json.loads(f'"{match.group(1)}"')
        if name not in self.names:
            self.phase = "whole"
            return []
        rest = self.buffer[match.end() :]
        self.phase = "args"
        if rest.lstrip()[:1] == '"':  # arguments given as a JSON string: parsed whole
            self.phase = "whole"
            return []
        self.buffer = ""
        return [CallDelta(self.index, self.call_id, name), *self._arguments(rest)]

    def _arguments(self, text: str) -> list[CallDelta]:
        piece = []
        for char in text:
            if not self.started:
                if char.isspace():
                    continue
                self.started = True
            piece.append(char)
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.in_string = False
            elif char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                self.depth -= 1
                if self.depth <= 0:
                    self.phase = "done"
                    break
        return [CallDelta(self.index, arguments="".join(piece))] if piece else []

    def finish(self) -> tuple[list[CallDelta], str]:
        """The call if it was parsed whole, or the text back if it is not a call."""
        if self.phase in ("args", "done"):
            return [], ""
        try:
            value, _ = json.JSONDecoder().raw_decode(self.buffer.strip())
        except ValueError:
            return [], self.buffer
        if not isinstance(value, dict) or value.get("name") not in self.names:
            return [], self.buffer
        arguments = value.get("arguments", value.get("parameters", {}))
        text = arguments if isinstance(arguments, str) else json.dumps(arguments)
        return [CallDelta(self.index, self.call_id, value["name"], text)], ""


class ToolCallParser:
    """Feed generated text in pieces; get text and call pieces back (``Parsed``)."""

    def __init__(self, plan: ToolPlan, new_id: Callable[[], str]) -> None:
        self.plan = plan
        self.new_id = new_id
        self.num_calls = 0
        self._pending = ""  # auto: text not yet known to be plain (it may open a block)
        self._decided = False  # auto: whether the answer is a bare call has been decided
        self._bare: _CallScanner | None = None  # auto: the answer is one bare call (maybe)
        self._block: _CallScanner | None = None  # the call being read (in a block, or required)
        if plan.mode == "required":
            self._block = self._new_scanner()

    def _new_scanner(self) -> _CallScanner:
        scanner = _CallScanner(self.num_calls, self.new_id(), self.plan.names)
        self.num_calls += 1
        return scanner

    def feed(self, text: str) -> Parsed:
        if self.plan.mode == "named":
            calls = []
            if self.num_calls == 0:
                self.num_calls = 1
                calls.append(CallDelta(0, self.new_id(), self.plan.named))
            if text:
                calls.append(CallDelta(0, arguments=text))
            return Parsed(calls=calls)
        if self.plan.mode == "required":
            assert self._block is not None
            return Parsed(calls=self._block.feed(text))
        return self._auto(text)

    def _auto(self, text: str) -> Parsed:
        self._pending += text
        out = Parsed()
        if self._bare is not None:
            self._bare.buffer += self._pending
            self._pending = ""
            return out
        if not self._decided:
            if not self._pending.strip():
                return out
            self._decided = True
            if self._pending.lstrip().startswith("{"):  # the answer may be one bare call
                self._bare = _CallScanner(0, self.new_id(), self.plan.names)
                self._bare.phase = "whole"
                self._bare.buffer, self._pending = self._pending, ""
                return out
        while self._pending:
            if self._block is None:
                start = self._pending.find(OPEN)
                if start < 0:
                    cut = len(self._pending) - _partial_suffix(self._pending, OPEN)
                    out.content += self._pending[:cut]
                    self._pending = self._pending[cut:]
                    break
                out.content += self._pending[:start]
                self._pending = self._pending[start + len(OPEN) :]
                self._block = self._new_scanner()
                continue
            end = self._pending.find(CLOSE)
            if end < 0:
                cut = len(self._pending) - _partial_suffix(self._pending, CLOSE)
                out.calls.extend(self._block.feed(self._pending[:cut]))
                self._pending = self._pending[cut:]
                break
            out.calls.extend(self._block.feed(self._pending[:end]))
            self._pending = self._pending[end + len(CLOSE) :]
            out.add(self._end_block(CLOSE))
        return out

    def _end_block(self, close: str) -> Parsed:
        block, self._block = self._block, None
        if block is None:
            return Parsed()
        calls, text = block.finish()
        if not calls and text:  # not a call (nothing of it was sent as one): it stays text
            self.num_calls -= 1
            return Parsed(content=OPEN + text + close)
        return Parsed(calls=calls)

    def finish(self) -> Parsed:
        """What is left when the answer ends."""
        out = Parsed()
        if self.plan.mode == "required" and self._block is not None:
            out.calls.extend(self._block.finish()[0])
        elif self._bare is not None:
            calls, text = self._bare.finish()
            self.num_calls = len(calls)
            out.calls.extend(calls)
            out.content += text
        elif self._block is not None:  # a block the answer did not close
            out.calls.extend(self._block.feed(self._pending))
            self._pending = ""
            out.add(self._end_block(""))
        out.content += self._pending
        self._pending = ""
        return out


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that begins ``marker`` (kept back for now)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def collect_calls(deltas: list[CallDelta]) -> list[ToolCall]:
    """Call pieces joined into whole calls, in order."""
    calls: dict[int, ToolCall] = {}
    for delta in deltas:
        call = calls.get(delta.index)
        if call is None:
            call = calls[delta.index] = ToolCall(
                id=delta.id or "", function=FunctionCall(name=delta.name or "", arguments="")
            )
        call.function.arguments += delta.arguments
    return [calls[i] for i in sorted(calls)]


def parse_all(plan: ToolPlan, text: str, new_id: Callable[[], str]) -> tuple[str, list[ToolCall]]:
    """A whole answer's text (outside calls) and its calls."""
    parser = ToolCallParser(plan, new_id)
    parsed = parser.feed(text)
    parsed.add(parser.finish())
    return parsed.content, collect_calls(parsed.calls)
