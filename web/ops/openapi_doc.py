"""The OpenAPI document at ``/schema/openapi.json``, completed where Litestar cannot see.

The generation routes read their raw body (to name unknown fields in a 400), so Litestar knows
neither their request nor their streamed response types; they are added here from the msgspec
structs, with the error shape every route answers in and the bearer authentication.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec
from litestar import Litestar
from litestar._openapi.plugin import OpenAPIPlugin

from web.openai import schemas, tokens
from web.openai.batch import routes as batch_routes
from web.ops.errors import ERROR_TYPES, ErrorBody

REF = "#/components/schemas/{name}"
# Routes whose handler decodes its own body: the body's type, and the answer's when Litestar
# cannot tell it (a JSON answer, or a stream of chunks with ``stream: true``).
RAW_BODIES: Mapping[str, tuple[type[Any], type[Any] | None, type[Any] | None]] = {
    "/v1/chat/completions": (
        schemas.ChatCompletionRequest,
        schemas.ChatCompletion,
        schemas.ChatCompletionChunk,
    ),
    "/v1/completions": (schemas.CompletionRequest, schemas.TextCompletion, schemas.TextCompletion),
    "/tokenize": (tokens.TokenizeRequest, None, None),
    "/detokenize": (tokens.DetokenizeRequest, None, None),
    "/v1/batches": (batch_routes.BatchCreate, None, None),
}
# Routes that take a multipart form (the Batch API's uploads) and the form's parts.
FORM_BODIES: Mapping[str, dict[str, Any]] = {
    "/v1/files": {
        "type": "object",
        "properties": {
            "file": {"type": "string", "format": "binary", "description": "JSON lines"},
            "purpose": {"type": "string", "enum": ["batch"]},
        },
        "required": ["file", "purpose"],
    },
}
# The errors each kind of route may answer with, all in the ``{"error": {...}}`` shape.
TENANT_ERRORS = (400, 401, 403, 404, 413, 429, 503)
ADMIN_ERRORS = (400, 401, 403, 404, 409, 503)
OPEN_PATHS = ("/healthz", "/readyz", "/metrics")


def describe(app: Litestar) -> None:
    """Complete the app's OpenAPI document in place (Litestar builds it once and caches it)."""
    plugin = app.plugins.get(OpenAPIPlugin)
    complete(plugin.provide_openapi_schema())


def complete(doc: dict[str, Any]) -> dict[str, Any]:
    """Add the raw routes' bodies, the error responses and the bearer scheme to ``doc``."""
    types = [t for bodies in RAW_BODIES.values() for t in bodies if t is not None]
    _, components = msgspec.json.schema_components([*types, ErrorBody], ref_template=REF)
    known = doc.setdefault("components", {}).setdefault("schemas", {})
    for name, schema in components.items():
        known.setdefault(name, schema)
    doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    for path, operations in doc.get("paths", {}).items():
        for method, operation in operations.items():
            if not isinstance(operation, dict) or method not in ("get", "post", "put", "patch",
                                                                 "delete"):  # fmt: skip
                continue
            raw = RAW_BODIES.get(path)
            if raw is not None and method == "post":
                _describe_raw(operation, *raw)
            form = FORM_BODIES.get(path)
            if form is not None and method == "post":
                content = {"multipart/form-data": {"schema": form}}
                operation["requestBody"] = {"required": True, "content": content}
            if path in OPEN_PATHS:
                continue
            operation.setdefault("security", [{"bearer": []}])
            codes = ADMIN_ERRORS if path.startswith("/admin/") else TENANT_ERRORS
            responses = operation.setdefault("responses", {})
            for code in codes:
                responses.setdefault(str(code), _error_response(code))
    return doc


def _ref(type_: type[Any]) -> dict[str, str]:
    return {"$ref": REF.format(name=type_.__name__)}


def _describe_raw(
    operation: dict[str, Any],
    body: type[Any],
    answer: type[Any] | None,
    chunk: type[Any] | None,
) -> None:
    operation["requestBody"] = {
        "required": True,
        "content": {"application/json": {"schema": _ref(body)}},
    }
    if answer is None:
        return
    content: dict[str, Any] = {"application/json": {"schema": _ref(answer)}}
    if chunk is not None:
        content["text/event-stream"] = {
            "schema": {"type": "string"},
            "description": f"With stream: true, `data: <{chunk.__name__}>` lines, then "
            "`data: [DONE]`.",
        }
    operation.setdefault("responses", {})["200"] = {"description": "The answer", "content": content}


def _error_response(code: int) -> dict[str, Any]:
    kind = ERROR_TYPES.get(code, "invalid_request_error")
    return {
        "description": f"An error ({kind})",
        "content": {"application/json": {"schema": _ref(ErrorBody)}},
    }
