"""The one exception-to-HTTP mapping: statuses, the error body, retry and rate-limit headers."""

from __future__ import annotations

import msgspec
import pytest
from litestar.exceptions import NotFoundException, ValidationException

from engine.errors import EngineDeadError, EngineOverloadedError, PromptTooLongError
from tenants.errors import (
    InvalidKeyError,
    PromptTooLargeError,
    QuotaExceededError,
    TenantSuspendedError,
)
from web.ops.errors import ApiError, error_response, retry_headers, to_api_error


@pytest.mark.parametrize(
    ("exc", "status", "code"),
    [
        (InvalidKeyError("bad key"), 401, "invalid_api_key"),
        (TenantSuspendedError("suspended"), 403, "tenant_suspended"),
        (PromptTooLargeError("long", limit=10, prompt_tokens=20), 413, "prompt_too_large"),
        (PromptTooLongError("too long", "messages"), 400, "context_length_exceeded"),
        (EngineOverloadedError("busy"), 503, "overloaded"),
        (EngineDeadError("dead"), 503, "engine_dead"),
        (NotFoundException(), 404, "not_found"),
        (ValidationException("bad"), 400, "invalid_request"),
        (RuntimeError("boom"), 500, "internal"),
    ],
)
def test_status_and_code(exc: Exception, status: int, code: str) -> None:
    error = to_api_error(exc)
    assert (error.status_code, error.code) == (status, code)


def test_body_has_openai_shape() -> None:
    error = ApiError(400, "max_tokens must be positive", code="invalid_request", param="max_tokens")
    response = error_response(error)
    assert response.status_code == 400
    assert response.content == {
        "error": {
            "message": "max_tokens must be positive",
            "type": "invalid_request_error",
            "param": "max_tokens",
            "code": "invalid_request",
        }
    }
    msgspec.json.encode(response.content)


def test_internal_errors_do_not_leak_details() -> None:
    error = to_api_error(RuntimeError("secret path /etc/x"))
    assert "secret" not in error.message


def test_quota_refusal_carries_retry_and_ratelimit_headers() -> None:
    exc = QuotaExceededError(
        "slow down",
        reason="requests_per_minute",
        retry_after_s=2.25,
        limit_requests=60,
        remaining_requests=0,
        limit_tokens=None,
        remaining_tokens=None,
    )
    error = to_api_error(exc)
    assert error.status_code == 429
    assert error.headers == {
        "Retry-After": "3",
        "retry-after-ms": "2250",
        "x-ratelimit-limit-requests": "60",
        "x-ratelimit-remaining-requests": "0",
    }


def test_overload_has_retry_after() -> None:
    assert to_api_error(EngineOverloadedError("busy")).headers["Retry-After"] == "1"


@pytest.mark.parametrize(("seconds", "header"), [(0.0, "1"), (0.2, "1"), (1.0, "1"), (1.01, "2")])
def test_retry_after_rounds_up_to_whole_seconds(seconds: float, header: str) -> None:
    assert retry_headers(seconds)["Retry-After"] == header
