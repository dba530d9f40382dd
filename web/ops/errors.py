"""The one mapping from exceptions to HTTP: OpenAI's ``{"error": {...}}`` body and headers."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec
import structlog
from litestar import Request, Response
from litestar.exceptions import HTTPException

from atrium_errors import AtriumError
from engine.errors import EngineError, InvalidRequestError
from tenants.errors import BudgetExhaustedError, QuotaExceededError
from tenants.rate_limit import RateState
from web.ops.rate_headers import ratelimit_headers

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
# Codes whose ``type`` is not their status's: OpenAI types a spent quota apart from a rate limit.
CODE_TYPES = {"insufficient_quota": "insufficient_quota"}
# Each error code and its status, engine and tenant domain alike.
STATUS = {
    "invalid_request": 400,
    "context_length_exceeded": 400,
    "invalid_api_key": 401,
    "tenant_suspended": 403,
    "not_found": 404,
    "tenant_not_found": 404,
    "key_not_found": 404,
    "conflict": 409,
    "duplicate_request": 409,
    "prompt_too_large": 413,
    "tokens_exceed_limit": 400,
    "rate_limit_exceeded": 429,
    "insufficient_quota": 429,
    "overloaded": 503,
    "engine_dead": 503,
    "meter_closed": 503,
}
# A code without its own status takes the first family's it belongs to: a request the engine
# refused is the client's; an engine that cannot serve is unavailable; anything else is ours.
FAMILY_STATUS: tuple[tuple[type[AtriumError], int], ...] = (
    (InvalidRequestError, 400),
    (EngineError, 503),
    (AtriumError, 500),
)
INTERNAL_MESSAGE = "The server had an error while processing your request."


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
        type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.code = code
        self.param = param
        self.headers: dict[str, str] = dict(headers or {})
        # OpenAI's error type: by default the status's (ERROR_TYPES), or the code's (CODE_TYPES).
        self.type = type or CODE_TYPES.get(code) or ERROR_TYPES.get(status_code)


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


def error_response(
    error: ApiError, extra_headers: Mapping[str, str] | None = None
) -> Response[Any]:
    detail = ErrorDetail(
        message=error.message,
        type=error.type or "invalid_request_error",
        param=error.param,
        code=error.code,
    )
    return Response(
        content=msgspec.to_builtins(ErrorBody(error=detail)),
        status_code=error.status_code,
        headers={**(extra_headers or {}), **error.headers},
        media_type="application/json",
    )


def to_api_error(exc: Exception) -> ApiError:
    """Classify any exception; anything unknown becomes a 500 (and is logged by the caller)."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, AtriumError):
        return _from_atrium(exc)
    if isinstance(exc, HTTPException):
        return _from_litestar(exc)
    return ApiError(500, INTERNAL_MESSAGE, code="internal")


def _from_atrium(exc: AtriumError) -> ApiError:
    status = STATUS.get(exc.code)
    if status is None:
        status = next(status for family, status in FAMILY_STATUS if isinstance(exc, family))
    if status == 500:
        return ApiError(500, INTERNAL_MESSAGE, code=exc.code)
    headers: dict[str, str] = {}
    rate = getattr(exc, "rate", None)
    if isinstance(rate, RateState):  # admission's refusals say where the per-minute limits are
        headers |= ratelimit_headers(rate)
    if isinstance(exc, BudgetExhaustedError):
        # Nothing helps before the budget resets (the message says when): clients that retry
        # a 429 by themselves (OpenAI's SDKs) are told not to.
        headers["x-should-retry"] = "false"
    elif isinstance(exc, QuotaExceededError):
        headers |= retry_headers(exc.retry_after_s)
    elif isinstance(exc, EngineError) and status == 503:
        headers = retry_headers(1.0)
    param = getattr(exc, "param", None)
    return ApiError(status, str(exc) or exc.code, code=exc.code, param=param, headers=headers)


def _from_litestar(exc: HTTPException) -> ApiError:
    status = exc.status_code
    if status == 404:
        return ApiError(404, "Unknown route.", code="not_found")
    if status == 405:
        return ApiError(405, "Method not allowed for this route.", code="method_not_allowed")
    if status == 413:
        return ApiError(413, "Request body is too large.", code="request_too_large")
    if 400 <= status < 500:
        # Litestar's own validation (path/query parameters, malformed bodies): name each field
        # that failed and why, as msgspec said it, not only "Validation failed for POST /path".
        problems = (
            [e for e in exc.extra if isinstance(e, dict)] if isinstance(exc.extra, list) else []
        )
        said = "; ".join(
            f"{p['key']}: {p.get('message', 'invalid')}" if p.get("key") else str(p.get("message"))
            for p in problems
            if p.get("key") or p.get("message")
        )
        message = f"{exc.detail}: {said}" if said else str(exc.detail)
        param = next((str(p["key"]) for p in problems if p.get("key")), None)
        return ApiError(status, message, code="invalid_request", param=param)
    return ApiError(status, str(exc.detail), code="internal")


# The request state's callable giving the authenticated key's ``x-ratelimit-*`` headers.
RATE_HEADERS = "atrium_rate_headers"
RATELIMIT = "x-ratelimit-"
CLIENT_CLOSED = 499  # nginx's "client closed request": the client left before its answer
REFUSALS = (401, 403, 429, 503)  # the statuses /metrics counts as refusals


def handle_exception(request: Request[Any, Any, Any], exc: Exception) -> Response[Any]:
    """Litestar exception handler for ``Exception``: every error leaves in OpenAI's shape."""
    error = to_api_error(exc)
    if error.status_code >= 500 and error.code == "internal":
        log.error("unhandled_exception", path=request.url.path, exc_info=exc)
    elif error.status_code == CLIENT_CLOSED:  # the client's doing, at will: no error
        log.info("client_closed_request", path=request.url.path)
    metrics = request.app.state.get("metrics")
    if error.status_code in REFUSALS and metrics is not None:
        metrics.count_refusal(error.status_code, refusal_reason(exc, error))
    rate_headers = request.state.get(RATE_HEADERS)
    if callable(rate_headers) and not any(h.startswith(RATELIMIT) for h in error.headers):
        # An authenticated tenant's error says where its per-minute limits are, as its answers do.
        return error_response(error, rate_headers())
    return error_response(error)


def refusal_reason(exc: BaseException, error: ApiError) -> str:
    """Why a request was refused: a 429 by the quota that refused it, others by their code."""
    reason = exc.reason if isinstance(exc, QuotaExceededError) else error.code
    return reason or "unknown"
