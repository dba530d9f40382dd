"""The OpenAPI document at ``/schema/openapi.json``, completed where Litestar cannot see.

The generation routes read their raw body (to name unknown fields in a 400), so Litestar knows
neither their request nor their streamed response types; they are added here from the msgspec
structs their face lists (``web.openai.openapi_bodies``), with the error shape every route
answers in and the bearer authentication.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec
from litestar import Litestar
from litestar._openapi.plugin import OpenAPIPlugin

from web.ops.errors import ERROR_TYPES, ErrorBody

REF = "#/components/schemas/{name}"
# A route whose handler decodes its own body: the body's type, and the answer's when Litestar
# cannot tell it (a JSON answer, or a stream of chunks with ``stream: true``), by path.
RawBodies = Mapping[str, tuple[type[Any], type[Any] | None, type[Any] | None]]
# A route that takes a multipart form, and the form's schema, by path.
FormBodies = Mapping[str, dict[str, Any]]
# The errors each kind of route may answer with, all in the ``{"error": {...}}`` shape.
TENANT_ERRORS = (400, 401, 403, 404, 413, 429, 503)
ADMIN_ERRORS = (400, 401, 403, 404, 409, 503)
OPEN_PATHS = ("/healthz", "/readyz", "/metrics")


def describe(app: Litestar, raw_bodies: RawBodies, form_bodies: FormBodies) -> None:
    """Complete the app's OpenAPI document in place (Litestar builds it once and caches it)."""
    plugin = app.plugins.get(OpenAPIPlugin)
    complete(plugin.provide_openapi_schema(), raw_bodies, form_bodies)


def complete(doc: dict[str, Any], raw_bodies: RawBodies, form_bodies: FormBodies) -> dict[str, Any]:
    """Add the raw routes' bodies, the error responses and the bearer scheme to ``doc``."""
    types = [t for bodies in raw_bodies.values() for t in bodies if t is not None]
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
            raw = raw_bodies.get(path)
            if raw is not None and method == "post":
                _describe_raw(operation, *raw)
            form = form_bodies.get(path)
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
