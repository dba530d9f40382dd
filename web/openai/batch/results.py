"""Batch lines' results in OpenAI's output-file format, and a finished batch's two files.

A line's result is ``{"id", "custom_id", "response": {"status_code", "request_id", "body"},
"error"}``: a 200 goes to the output file, anything else to the error file. A line the batch
never ran (it expired first) has no response and an ``error`` naming why.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from typing import Any

import msgspec

from tenants.models import BatchLineRow
from web.ops.errors import ERROR_TYPES, ApiError


def _line_id() -> str:
    return f"batch_req_{secrets.token_hex(12)}"


def success(custom_id: str, request_id: str, body: dict[str, Any]) -> dict[str, Any]:
    response = {"status_code": 200, "request_id": request_id, "body": body}
    return {"id": _line_id(), "custom_id": custom_id, "response": response, "error": None}


def refusal(custom_id: str, request_id: str, error: ApiError) -> dict[str, Any]:
    """A line refused as the interactive route would refuse it: its status and error body."""
    detail = {
        "message": error.message,
        "type": ERROR_TYPES.get(error.status_code, "invalid_request_error"),
        "param": error.param,
        "code": error.code,
    }
    response = {
        "status_code": error.status_code,
        "request_id": request_id,
        "body": {"error": detail},
    }
    return {"id": _line_id(), "custom_id": custom_id, "response": response, "error": None}


def not_run(custom_id: str, code: str, message: str) -> dict[str, Any]:
    return {
        "id": _line_id(),
        "custom_id": custom_id,
        "response": None,
        "error": {"code": code, "message": message},
    }


def succeeded(result: dict[str, Any] | None) -> bool:
    response = (result or {}).get("response")
    return isinstance(response, dict) and response.get("status_code") == 200


def output_files(lines: Sequence[BatchLineRow]) -> list[tuple[str, bytes, int]]:
    """``("output"|"error", bytes, lines)`` for the lines that finished, in input order; a file
    with no line is not made."""
    output: list[bytes] = []
    errors: list[bytes] = []
    for line in lines:
        if line.result is None:
            continue
        encoded = msgspec.json.encode(line.result) + b"\n"
        (output if succeeded(line.result) else errors).append(encoded)
    files = []
    for kind, chunks in (("output", output), ("error", errors)):
        if chunks:
            files.append((kind, b"".join(chunks), len(chunks)))
    return files
