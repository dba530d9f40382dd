"""A Batch API input file checked line by line: one JSON request per line, custom ids unique.

Each line is ``{"custom_id": str, "method": "POST", "url": <endpoint>, "body": {...}}``, as
OpenAI's batch input format has it. A file that breaks any rule is refused whole, naming the line.
"""

from __future__ import annotations

from typing import Any

import msgspec

from tenants.errors import InvalidInputError

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
MAX_CUSTOM_ID_CHARS = 64
LINE_KEYS = frozenset({"custom_id", "method", "url", "body"})


class InputLine(msgspec.Struct, frozen=True):
    custom_id: str
    url: str
    body: str  # the request body, re-encoded JSON


def parse_input(content: bytes, max_lines: int) -> list[InputLine]:
    """The lines of a batch input file, or InvalidInputError naming the first bad one."""
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidInputError("The file is not valid UTF-8.", "file") from None
    raw_lines = text.split("\n")
    if raw_lines and raw_lines[-1] == "":
        raw_lines.pop()  # the newline that ends the last line
    if not raw_lines:
        raise InvalidInputError("The file has no requests.", "file")
    if len(raw_lines) > max_lines:
        raise InvalidInputError(
            f"The file has {len(raw_lines)} lines; a batch takes at most {max_lines}.", "file"
        )
    lines: list[InputLine] = []
    seen: set[str] = set()
    for number, raw in enumerate(raw_lines, start=1):
        line = _parse_line(raw.rstrip("\r"), number)
        if line.custom_id in seen:
            raise InvalidInputError(
                f"Line {number}: custom_id {line.custom_id!r} is used by an earlier line; "
                "each line's custom_id must be unique.",
                "file",
            )
        seen.add(line.custom_id)
        lines.append(line)
    return lines


def _parse_line(raw: str, number: int) -> InputLine:
    def bad(reason: str) -> InvalidInputError:
        return InvalidInputError(f"Line {number}: {reason}", "file")

    if not raw.strip():
        raise bad("the line is empty.")
    try:
        value: Any = msgspec.json.decode(raw)
    except (msgspec.DecodeError, RecursionError):
        raise bad("not valid JSON.") from None
    if not isinstance(value, dict):
        raise bad("a line must be a JSON object.")
    unknown = sorted(set(value) - LINE_KEYS)
    if unknown:
        raise bad(f"unknown field {unknown[0]!r}.")
    custom_id = value.get("custom_id")
    if not isinstance(custom_id, str) or not 0 < len(custom_id) <= MAX_CUSTOM_ID_CHARS:
        raise bad(f"custom_id must be a string of 1 to {MAX_CUSTOM_ID_CHARS} characters.")
    if not custom_id.isprintable():
        raise bad("custom_id must be printable.")
    if value.get("method") != "POST":
        raise bad('method must be "POST".')
    url = value.get("url")
    if url not in ENDPOINTS:
        raise bad(f"url must be one of {', '.join(ENDPOINTS)}.")
    body = value.get("body")
    if not isinstance(body, dict):
        raise bad("body must be a JSON object.")
    if body.get("stream") not in (None, False):
        raise bad("batch requests cannot stream.")
    return InputLine(custom_id, str(url), msgspec.json.encode(body).decode())
