"""Tenant-domain errors: each carries a stable ``code`` that the gateway maps to HTTP once."""

from __future__ import annotations

from datetime import datetime

from atrium_errors import AtriumError
from tenants.rate_limit import NO_LIMITS, RateState, RateView


class TenantError(AtriumError):
    """Base of the tenant domain's errors."""

    code = "tenant_error"


class InvalidInputError(TenantError, ValueError):
    """A value given to a service is malformed or out of range (HTTP 400)."""

    code = "invalid_request"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class NotFoundError(TenantError):
    """A tenant, key or price that does not exist (or was deleted) (HTTP 404)."""

    code = "not_found"


class TenantNotFoundError(NotFoundError):
    code = "tenant_not_found"


class KeyNotFoundError(NotFoundError):
    code = "key_not_found"


class ConflictError(TenantError):
    """The change collides with existing state, e.g. a duplicate tenant name (HTTP 409)."""

    code = "conflict"


class InvalidKeyError(TenantError):
    """The API key is missing, malformed, unknown or revoked (HTTP 401)."""

    code = "invalid_api_key"


class TenantSuspendedError(TenantError):
    """The key is valid but its tenant is suspended or deleted (HTTP 403)."""

    code = "tenant_suspended"


class PromptTooLargeError(TenantError):
    """The prompt exceeds the tenant's max_prompt_tokens (HTTP 413)."""

    code = "prompt_too_large"

    def __init__(self, message: str, limit: int, prompt_tokens: int) -> None:
        super().__init__(message)
        self.limit = limit
        self.prompt_tokens = prompt_tokens


class QuotaExceededError(RateView, TenantError):
    """A rate limit, the concurrency cap or a monthly budget refused the request (HTTP 429).

    ``reason`` names the limit (``requests_per_minute``, ``key_requests_per_minute``, …),
    ``scope`` whose it is (``"key"`` or ``"tenant"``); ``rate`` is the state of the per-minute
    limits, for the response's ``x-ratelimit-*`` headers.
    """

    code = "rate_limit_exceeded"

    def __init__(
        self,
        message: str,
        *,
        reason: str,
        retry_after_s: float,
        scope: str = "tenant",
        rate: RateState = NO_LIMITS,
    ) -> None:
        super().__init__(message)
        self.reason = reason
        self.retry_after_s = retry_after_s
        self.scope = scope
        self.rate = rate


class BudgetExhaustedError(QuotaExceededError):
    """A monthly budget (tokens, or money in micro-units) cannot cover the request until it
    resets at ``resets_at`` (HTTP 429 ``insufficient_quota``: retrying sooner cannot help)."""

    code = "insufficient_quota"

    def __init__(
        self,
        message: str,
        *,
        reason: str,
        budget: int,
        remaining: int,
        resets_at: datetime,
        retry_after_s: float,
        rate: RateState = NO_LIMITS,
    ) -> None:
        super().__init__(message, reason=reason, retry_after_s=retry_after_s, rate=rate)
        self.budget = budget
        self.remaining = remaining
        self.resets_at = resets_at


class LimitUnreachableError(TenantError):
    """The request asks for more than a limit ever allows (its prompt and ``max_tokens`` above
    the tokens per minute or the monthly budget): it can never be admitted (HTTP 400)."""

    code = "tokens_exceed_limit"

    def __init__(
        self,
        message: str,
        *,
        reason: str,
        limit: int,
        requested: int,
        param: str = "max_tokens",
        rate: RateState = NO_LIMITS,
    ) -> None:
        super().__init__(message)
        self.reason = reason
        self.limit = limit
        self.requested = requested
        self.param = param
        self.rate = rate


class DuplicateRequestError(TenantError):
    """A request id was admitted twice (HTTP 409)."""

    code = "duplicate_request"


class MeterClosedError(TenantError):
    """A usage event was recorded after the meter was closed."""

    code = "meter_closed"


class MigrationError(TenantError):
    """The Alembic scripts could not be located or applied."""

    code = "migration_error"


class SpoolInUseError(TenantError):
    """Another process already holds this usage spool file (one gateway per spool path)."""

    code = "spool_in_use"
