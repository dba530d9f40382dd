"""The one exception-to-HTTP mapping: statuses, the error body, retry and rate-limit headers."""

from __future__ import annotations

from datetime import UTC, datetime

import msgspec
import pytest
from litestar.exceptions import NotFoundException, ValidationException

from engine.errors import EngineDeadError, EngineOverloadedError, PromptTooLongError
from tenants.errors import (
    BudgetExhaustedError,
    InvalidKeyError,
    LimitUnreachableError,
    PromptTooLargeError,
    QuotaExceededError,
    TenantSuspendedError,
)
from tenants.rate_limit import RateState
from web.ops.errors import ApiError, error_response, retry_headers, to_api_error
from web.ops.rate_headers import aged, ratelimit_headers, reset_duration


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
    rate = RateState(limit_requests=60, remaining_requests=0, reset_requests_s=59.5)
    exc = QuotaExceededError(
        "slow down", reason="requests_per_minute", retry_after_s=2.25, rate=rate
    )
    error = to_api_error(exc)
    assert error.status_code == 429
    assert (error.type, error.code) == ("rate_limit_error", "rate_limit_exceeded")
    assert error.headers == {
        "Retry-After": "3",
        "retry-after-ms": "2250",
        "x-ratelimit-limit-requests": "60",
        "x-ratelimit-remaining-requests": "0",
        "x-ratelimit-reset-requests": "59.5s",
    }


def test_a_spent_budget_is_insufficient_quota_without_a_retry() -> None:
    resets = datetime(2031, 2, 1, tzinfo=UTC)
    rate = RateState(limit_tokens=1000, remaining_tokens=990, reset_tokens_s=0.6)
    exc = BudgetExhaustedError(
        "spent",
        reason="monthly_token_budget",
        budget=100,
        remaining=0,
        resets_at=resets,
        retry_after_s=2_197_093.0,
        rate=rate,
    )
    error = to_api_error(exc)
    body = error_response(error).content["error"]
    assert error.status_code == 429
    assert (body["type"], body["code"]) == ("insufficient_quota", "insufficient_quota")
    # No month-long Retry-After: a client is told not to retry at all.
    assert "Retry-After" not in error.headers and "retry-after-ms" not in error.headers
    assert error.headers == {
        "x-should-retry": "false",
        "x-ratelimit-limit-tokens": "1000",
        "x-ratelimit-remaining-tokens": "990",
        "x-ratelimit-reset-tokens": "600ms",
    }


def test_a_request_above_a_limit_itself_is_a_400() -> None:
    exc = LimitUnreachableError(
        "needs 5000", reason="tokens_per_minute", limit=1000, requested=5000
    )
    error = to_api_error(exc)
    assert (error.status_code, error.type, error.code) == (
        400,
        "invalid_request_error",
        "tokens_exceed_limit",
    )
    assert error.param == "max_tokens" and "Retry-After" not in error.headers


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0.0, "0s"),
        (0.0004, "0s"),
        (0.12, "120ms"),
        (1.0, "1s"),
        (8.64, "8.64s"),
        (59.9996, "1m0s"),
        (360.0, "6m0s"),
        (90.5, "1m30.5s"),
        (3723.0, "1h2m3s"),
    ],
)
def test_reset_headers_read_as_openai_writes_them(seconds: float, text: str) -> None:
    assert reset_duration(seconds) == text


def test_unlimited_limits_send_no_header() -> None:
    assert ratelimit_headers(RateState()) == {}
    only_tokens = ratelimit_headers(
        RateState(limit_tokens=10, remaining_tokens=4, reset_tokens_s=36.0)
    )
    assert set(only_tokens) == {
        "x-ratelimit-limit-tokens",
        "x-ratelimit-remaining-tokens",
        "x-ratelimit-reset-tokens",
    }


def test_aged_rate_state_refills_each_bucket_at_its_limit_per_minute() -> None:
    # 60 requests a minute: one a second; 600 tokens a minute: ten a second.
    rate = RateState(
        limit_requests=60,
        remaining_requests=50,
        reset_requests_s=10.0,
        limit_tokens=600,
        remaining_tokens=0,
        reset_tokens_s=60.0,
    )
    later = aged(rate, 4.0)
    assert (later.remaining_requests, later.reset_requests_s) == (54, 6.0)
    assert (later.remaining_tokens, later.reset_tokens_s) == (40, 56.0)
    full = aged(rate, 120.0)  # never more than the limit, never a negative reset
    assert (full.remaining_requests, full.reset_requests_s) == (60, 0.0)
    assert (full.remaining_tokens, full.reset_tokens_s) == (600, 0.0)
    assert aged(rate, -1.0) == rate
    assert aged(RateState(limit_requests=5), 3.0) == RateState(limit_requests=5)


def test_overload_has_retry_after() -> None:
    assert to_api_error(EngineOverloadedError("busy")).headers["Retry-After"] == "1"


@pytest.mark.parametrize(("seconds", "header"), [(0.0, "1"), (0.2, "1"), (1.0, "1"), (1.01, "2")])
def test_retry_after_rounds_up_to_whole_seconds(seconds: float, header: str) -> None:
    assert retry_headers(seconds)["Retry-After"] == header


def test_a_validation_error_names_the_field_and_why() -> None:
    exc = ValidationException(
        "Validation failed for POST /admin/v1/tenants",
        extra=[{"message": "Expected `int`, got `str`", "key": "requests_per_minute"}],
    )
    error = to_api_error(exc)
    assert (error.status_code, error.param) == (400, "requests_per_minute")
    assert error.message.endswith("requests_per_minute: Expected `int`, got `str`")
