"""The one mapping from exceptions to HTTP: OpenAI's ``{"error": {...}}`` body and headers."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec
import structlog
from litestar import Request, Response
from litestar.exceptions import HTTPException

from engine.errors import EngineError, InvalidRequestError
from tenants.errors import QuotaExceededError, TenantError

log = structlog.get_logger("atrium.web")

# OpenAI's error ``type`` for each status we produce.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}
# Engine error codes and their status.
ENGINE_STATUS = {
    "invalid_request": 400,
    "context_length_exceeded": 400,
    "overloaded": 503,
    "engine_dead": 503,
}
# Tenant-domain error codes and their status (subclasses share their base's status).
TENANT_STATUS = {
    "invalid_request": 400,
    "invalid_api_key": 401,
    "tenant_suspended": 403,
    "not_found": 404,
    "tenant_not_found": 404,
    "key_not_found": 404,
    "conflict": 409,
    "duplicate_request": 409,
    "prompt_too_large": 413,
    "rate_limit_exceeded": 429,
    "meter_closed": 503,
}


class ApiError(Exception):
    """An error a client sees as-is: a status, a stable code, the offending parameter."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        code: str,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.code = code
        self.param = param
        self.headers: dict[str, str] = dict(headers or {})


def bad_request(message: str, param: str | None = None, code: str = "invalid_request") -> ApiError:
    return ApiError(400, message, code=code, param=param)


def retry_headers(retry_after_s: float) -> dict[str, str]:
    """``Retry-After`` in whole seconds (at least 1) and ``retry-after-ms`` exactly."""
    seconds = max(1, int(-(-retry_after_s // 1)))
    return {"Retry-After": str(seconds), "retry-after-ms": str(max(0, int(retry_after_s * 1000)))}


def unavailable(message: str, retry_after_s: float, code: str = "overloaded") -> ApiError:
    return ApiError(503, message, code=code, headers=retry_headers(retry_after_s))


class ErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(msgspec.Struct):
    error: ErrorDetail


def error_response(error: ApiError) -> Response[Any]:
    detail = ErrorDetail(
        message=error.message,
        type=ERROR_TYPES.get(error.status_code, "invalid_request_error"),
        param=error.param,
        code=error.code,
    )
    return Response(
        content=msgspec.to_builtins(ErrorBody(error=detail)),
        status_code=error.status_code,
        headers=error.headers,
        media_type="application/json",
    )


def to_api_error(exc: Exception) -> ApiError:
    """Classify any exception; anything unknown becomes a 500 (and is logged by the caller)."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, InvalidRequestError):
        return ApiError(ENGINE_STATUS.get(exc.code, 400), str(exc), code=exc.code, param=exc.param)
    if isinstance(exc, EngineError):
        status = ENGINE_STATUS.get(exc.code, 503)
        headers = retry_headers(1.0) if status == 503 else None
        return ApiError(status, str(exc) or exc.code, code=exc.code, headers=headers)
    if isinstance(exc, TenantError):
        return _from_tenant(exc)
    if isinstance(exc, HTTPException):
        return _from_litestar(exc)
    return ApiError(500, "The server had an error while processing your request.", code="internal")


def _from_tenant(exc: TenantError) -> ApiError:
    status = TENANT_STATUS.get(exc.code)
    if status is None:
        return ApiError(
            500, "The server had an error while processing your request.", code=exc.code
        )
    headers: dict[str, str] = {}
    if isinstance(exc, QuotaExceededError):
        headers = retry_headers(exc.retry_after_s) | ratelimit_headers(
            exc.limit_requests, exc.remaining_requests, exc.limit_tokens, exc.remaining_tokens
        )
    param = getattr(exc, "param", None)
    return ApiError(status, str(exc) or exc.code, code=exc.code, param=param, headers=headers)


def ratelimit_headers(
    limit_requests: int | None,
    remaining_requests: int | None,
    limit_tokens: int | None,
    remaining_tokens: int | None,
) -> dict[str, str]:
    """``x-ratelimit-*`` headers for the limits the tenant has (unlimited ones are left out)."""
    values = {
        "x-ratelimit-limit-requests": limit_requests,
        "x-ratelimit-remaining-requests": remaining_requests,
        "x-ratelimit-limit-tokens": limit_tokens,
        "x-ratelimit-remaining-tokens": remaining_tokens,
    }
    return {name: str(value) for name, value in values.items() if value is not None}


def _from_litestar(exc: HTTPException) -> ApiError:
    status = exc.status_code
    if status == 404:
        return ApiError(404, "Unknown route.", code="not_found")
    if status == 405:
        return ApiError(405, "Method not allowed for this route.", code="method_not_allowed")
    if status == 413:
        return ApiError(413, "Request body is too large.", code="request_too_large")
    if 400 <= status < 500:
        # Litestar's own validation (path/query parameters, malformed bodies).
        return ApiError(status, str(exc.detail), code="invalid_request")
    return ApiError(status, str(exc.detail), code="internal")


REFUSALS = (401, 403, 429, 503)  # the statuses /metrics counts as refusals


def handle_exception(request: Request[Any, Any, Any], exc: Exception) -> Response[Any]:
    """Litestar exception handler for ``Exception``: every error leaves in OpenAI's shape."""
    error = to_api_error(exc)
    if error.status_code >= 500 and error.code == "internal":
        log.error("unhandled_exception", path=request.url.path, exc_info=exc)
    metrics = request.app.state.get("metrics")
    if error.status_code in REFUSALS and metrics is not None:
        # A 429 is counted by the quota that refused it; the others by their error code.
        reason = exc.reason if isinstance(exc, QuotaExceededError) else error.code
        metrics.count_refusal(error.status_code, reason or "unknown")
    return error_response(error)
