"""The Batch API in OpenAI's shapes: `/v1/files` (batch input uploads, outputs) and `/v1/batches`.

Files and batches live in the tenant database (``tenants.batch_files``, ``tenants.batch_store``);
a tenant sees only its own. Uploads are read in bounded chunks: past ``batch_max_file_bytes``
the request is refused with 413 before more is read.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import msgspec
from litestar import Request, Response, delete, get, post
from litestar._multipart import parse_content_header, parse_multipart_form
from litestar.datastructures import State, UploadFile
from litestar.di import NamedDependency
from litestar.params import FromPath

from tenants.batch_files import FileInfo, FileService
from tenants.batch_input import ENDPOINTS
from tenants.batch_store import BatchInfo, BatchStore
from web.openai.json_body import decode_json
from web.ops.errors import ApiError, bad_request
from web.settings import Settings
from web.tenancy.auth import INFERENCE, authenticate
from web.tenancy.principal import Principal, Tenancy

MAX_FORM_OVERHEAD = 64 * 1024  # multipart headers and the purpose field around the file


class BatchCreate(msgspec.Struct, forbid_unknown_fields=True):
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None


def _epoch(at: datetime | None) -> int | None:
    return None if at is None else int(at.timestamp())


def file_object(info: FileInfo) -> dict[str, Any]:
    return {
        "id": info.id,
        "object": "file",
        "bytes": info.num_bytes,
        "created_at": _epoch(info.created_at),
        "filename": info.filename,
        "purpose": info.purpose,
        "status": "processed",
        "expires_at": None,
        "status_details": None,
    }


def batch_object(info: BatchInfo) -> dict[str, Any]:
    counts, usage = info.request_counts, info.usage
    errors = None if info.errors is None else {"object": "list", "data": info.errors}
    return {
        "id": info.id,
        "object": "batch",
        "endpoint": info.endpoint,
        "errors": errors,
        "input_file_id": info.input_file_id,
        "completion_window": info.completion_window,
        "status": info.status,
        "output_file_id": info.output_file_id,
        "error_file_id": info.error_file_id,
        "created_at": _epoch(info.created_at),
        "in_progress_at": _epoch(info.in_progress_at),
        "expires_at": _epoch(info.expires_at),
        "finalizing_at": _epoch(info.finalizing_at),
        "completed_at": _epoch(info.completed_at),
        "failed_at": _epoch(info.failed_at),
        "expired_at": _epoch(info.expired_at),
        "cancelling_at": _epoch(info.cancelling_at),
        "cancelled_at": _epoch(info.cancelled_at),
        "request_counts": {
            "total": counts.total,
            "completed": counts.completed,
            "failed": counts.failed,
        },
        "metadata": info.metadata,
        # As OpenAI's batch object: the tokens its requests used so far.
        "usage": {
            "input_tokens": usage.input_tokens,
            "input_tokens_details": {"cached_tokens": usage.cached_tokens},
            "output_tokens": usage.output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.total_tokens,
        },
    }


def _page(data: list[dict[str, Any]], limit: int) -> dict[str, Any]:
    shown = data[:limit]
    return {
        "object": "list",
        "data": shown,
        "first_id": shown[0]["id"] if shown else None,
        "last_id": shown[-1]["id"] if shown else None,
        "has_more": len(data) > limit,
    }


def _limit(request: Request[Any, Any, Any]) -> int:
    raw = request.query_params.get("limit", "20")
    if not raw.isdigit() or not 1 <= int(raw) <= 100:
        raise bad_request("limit must be an integer from 1 to 100", "limit")
    return int(raw)


@dataclass(frozen=True, slots=True)
class BatchApi:
    """What the Batch API routes take (dependency ``batch_api``): the tenancy that checks keys,
    the file and batch stores (None without a tenant database) and the settings."""

    tenancy: Tenancy
    files: FileService | None
    batches: BatchStore | None
    settings: Settings

    async def enter(
        self, request: Request[Any, Any, Any]
    ) -> tuple[Principal, FileService, BatchStore]:
        """The key's principal and the stores: 401 for a bad key, then 404 without a database."""
        principal = await authenticate(request, self.tenancy, INFERENCE)
        if self.files is None or self.batches is None:
            raise ApiError(404, "The Batch API needs the tenant database.", code="not_found")
        return principal, self.files, self.batches


async def provide_batch_api(state: State) -> BatchApi:
    return BatchApi(
        state.tenancy, state.get("batch_files"), state.get("batch_store"), state.settings
    )


async def _capped(request: Request[Any, Any, Any], limit: int) -> AsyncGenerator[bytes, None]:
    seen = 0
    async for chunk in request.stream():
        seen += len(chunk)
        if seen > limit:
            raise ApiError(413, "The file is too large.", code="file_too_large", param="file")
        yield chunk


async def _form(request: Request[Any, Any, Any], limit: int) -> dict[str, Any]:
    content_type, options = parse_content_header(request.headers.get("content-type", ""))
    if content_type != "multipart/form-data" or "boundary" not in options:
        raise bad_request("Upload the file as multipart/form-data with `file` and `purpose`.")
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise ApiError(413, "The file is too large.", code="file_too_large", param="file")
    try:
        form = await parse_multipart_form(
            _capped(request, limit), options["boundary"].encode(), multipart_form_part_limit=8
        )
    except ApiError:
        raise
    except Exception as error:  # a malformed multipart body
        raise bad_request("The multipart body could not be read.") from error
    return form


@post("/v1/files", status_code=200, request_max_body_size=None)
async def upload_file(
    request: Request[Any, Any, Any], batch_api: NamedDependency[BatchApi]
) -> dict[str, Any]:
    principal, files, _ = await batch_api.enter(request)
    settings = batch_api.settings
    form = await _form(request, settings.batch_max_file_bytes + MAX_FORM_OVERHEAD)
    try:
        return await _store_upload(form, files, settings, principal.tenant_id)
    finally:
        for part in form.values():
            for value in part if isinstance(part, list) else [part]:
                if isinstance(value, UploadFile):
                    await value.close()


async def _store_upload(
    form: dict[str, Any], files: FileService, settings: Settings, tenant_id: str
) -> dict[str, Any]:
    unknown = sorted(set(form) - {"file", "purpose"})
    if unknown:
        raise ApiError(
            400, f"Unsupported field `{unknown[0]}`.", code="unsupported_parameter",
            param=unknown[0],
        )  # fmt: skip
    if form.get("purpose") != "batch":
        raise bad_request("purpose must be `batch`.", "purpose")
    upload = form.get("file")
    if not isinstance(upload, UploadFile):
        raise bad_request("A `file` part is required.", "file")
    content = await upload.read()
    if len(content) > settings.batch_max_file_bytes:
        raise ApiError(
            413, f"The file is larger than {settings.batch_max_file_bytes} bytes.",
            code="file_too_large", param="file",
        )  # fmt: skip
    filename = (upload.filename or "input.jsonl")[:255]
    if not filename.isprintable():
        raise bad_request("The file name must be printable.", "file")
    info = await files.upload(tenant_id, filename, content, max_lines=settings.batch_max_lines)
    return file_object(info)


@get("/v1/files")
async def list_files(
    request: Request[Any, Any, Any], batch_api: NamedDependency[BatchApi]
) -> dict[str, Any]:
    principal, files, _ = await batch_api.enter(request)
    limit = _limit(request)
    if request.query_params.get("order", "desc") != "desc":
        raise ApiError(
            400, "Files are listed newest first only (order=desc).",
            code="unsupported_parameter", param="order",
        )  # fmt: skip
    purpose = request.query_params.get("purpose")
    after = request.query_params.get("after")
    found = await files.list_files(
        principal.tenant_id, purpose=purpose, limit=limit + 1, after=after
    )
    return _page([file_object(info) for info in found], limit)


@get("/v1/files/{file_id:str}")
async def retrieve_file(
    request: Request[Any, Any, Any], file_id: FromPath[str], batch_api: NamedDependency[BatchApi]
) -> dict[str, Any]:
    principal, files, _ = await batch_api.enter(request)
    return file_object(await files.get(principal.tenant_id, file_id))


@get("/v1/files/{file_id:str}/content")
async def file_content(
    request: Request[Any, Any, Any], file_id: FromPath[str], batch_api: NamedDependency[BatchApi]
) -> Response[bytes]:
    principal, files, _ = await batch_api.enter(request)
    _, content = await files.content(principal.tenant_id, file_id)
    return Response(content, media_type="application/jsonl")


@delete("/v1/files/{file_id:str}", status_code=200)
async def delete_file(
    request: Request[Any, Any, Any], file_id: FromPath[str], batch_api: NamedDependency[BatchApi]
) -> dict[str, Any]:
    principal, files, _ = await batch_api.enter(request)
    await files.delete(principal.tenant_id, file_id)
    return {"id": file_id, "object": "file", "deleted": True}


@post("/v1/batches", status_code=200)
async def create_batch(
    request: Request[Any, Any, Any], batch_api: NamedDependency[BatchApi]
) -> dict[str, Any]:
    principal, _, batches = await batch_api.enter(request)
    settings = batch_api.settings
    body = decode_json(await request.body(), BatchCreate)
    if body.endpoint not in ENDPOINTS:
        raise bad_request(f"endpoint must be one of {', '.join(ENDPOINTS)}.", "endpoint")
    info = await batches.create(
        principal.tenant_id,
        principal.key_id,
        input_file_id=body.input_file_id,
        endpoint=body.endpoint,
        completion_window=body.completion_window,
        metadata=body.metadata,
        max_lines=settings.batch_max_lines,
    )
    return batch_object(info)


@get("/v1/batches")
async def list_batches(
    request: Request[Any, Any, Any], batch_api: NamedDependency[BatchApi]
) -> dict[str, Any]:
    principal, _, batches = await batch_api.enter(request)
    limit = _limit(request)
    after = request.query_params.get("after")
    found = await batches.list_batches(principal.tenant_id, limit=limit + 1, after=after)
    return _page([batch_object(info) for info in found], limit)


@get("/v1/batches/{batch_id:str}")
async def retrieve_batch(
    request: Request[Any, Any, Any], batch_id: FromPath[str], batch_api: NamedDependency[BatchApi]
) -> dict[str, Any]:
    principal, _, batches = await batch_api.enter(request)
    return batch_object(await batches.get(principal.tenant_id, batch_id))


@post("/v1/batches/{batch_id:str}/cancel", status_code=200)
async def cancel_batch(
    request: Request[Any, Any, Any], batch_id: FromPath[str], batch_api: NamedDependency[BatchApi]
) -> dict[str, Any]:
    principal, _, batches = await batch_api.enter(request)
    return batch_object(await batches.cancel(principal.tenant_id, batch_id))


ROUTES = [
    upload_file,
    list_files,
    retrieve_file,
    file_content,
    delete_file,
    create_batch,
    list_batches,
    retrieve_batch,
    cancel_batch,
]
