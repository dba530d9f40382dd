"""Batch input files: one JSON request per line, custom ids unique, every rule naming its line."""

from __future__ import annotations

import msgspec
import pytest

from tenants.batch_input import parse_input
from tenants.errors import InvalidInputError

CHAT = "/v1/chat/completions"


def _jsonl(count: int, url: str = CHAT) -> bytes:
    lines = [
        {"custom_id": f"req-{n}", "method": "POST", "url": url, "body": {"model": "m"}}
        for n in range(count)
    ]
    return b"".join(msgspec.json.encode(line) + b"\n" for line in lines)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "no requests"),
        (b'{"custom_id": "a"\n', "Line 1: not valid JSON"),
        (_jsonl(1) + b"\n" + _jsonl(1), "Line 2: the line is empty"),
        (_jsonl(2)[: len(_jsonl(1))] * 2, "Line 2: custom_id 'req-0' is used by an earlier"),
        (_jsonl(1, "/v1/embeddings"), "url must be one of"),
        (b'{"custom_id": "a", "method": "GET", "url": "/v1/completions", "body": {}}', "method"),
        (b'{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": [1]}', "body"),
        (
            b'{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {}, "x": 1}',
            "unknown field 'x'",
        ),
        (
            b'{"custom_id": "a", "method": "POST", "url": "/v1/completions", '
            b'"body": {"stream": true}}',
            "cannot stream",
        ),
        (_jsonl(6), "at most 5"),
        (b"\xff\xfe", "UTF-8"),
    ],
)
def test_malformed_input_files_are_refused_naming_the_line(content: bytes, message: str) -> None:
    with pytest.raises(InvalidInputError, match=message):
        parse_input(content, max_lines=5)


def test_a_good_file_keeps_its_lines_in_order() -> None:
    lines = parse_input(_jsonl(3).replace(b"\n", b"\r\n"), max_lines=5)
    assert [line.custom_id for line in lines] == ["req-0", "req-1", "req-2"]
    assert msgspec.json.decode(lines[0].body) == {"model": "m"}
