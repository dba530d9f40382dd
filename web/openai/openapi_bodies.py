"""The OpenAI face's part of the OpenAPI document: the routes that decode their own body (and
the Batch API's upload form), described in the app's document by ``web.ops.openapi_doc``."""

from __future__ import annotations

from litestar import Litestar

from web.openai import schemas, tokens
from web.openai.batch import routes as batch_routes
from web.ops import openapi_doc
from web.ops.openapi_doc import FormBodies, RawBodies

# Routes whose handler decodes its own body: the body's type, and the answer's when Litestar
# cannot tell it (a JSON answer, or a stream of chunks with ``stream: true``).
RAW_BODIES: RawBodies = {
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
FORM_BODIES: FormBodies = {
    "/v1/files": {
        "type": "object",
        "properties": {
            "file": {"type": "string", "format": "binary", "description": "JSON lines"},
            "purpose": {"type": "string", "enum": ["batch"]},
        },
        "required": ["file", "purpose"],
    },
}


def describe(app: Litestar) -> None:
    """Complete the app's OpenAPI document with these bodies (run once at startup)."""
    openapi_doc.describe(app, RAW_BODIES, FORM_BODIES)
