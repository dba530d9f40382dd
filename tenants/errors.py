"""Tenant-domain errors: each carries a stable ``code`` that the gateway maps to HTTP once."""

from __future__ import annotations

from atrium_errors import AtriumError


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


class QuotaExceededError(TenantError):
    """A rate limit, the concurrency cap or the monthly budget refused the request (HTTP 429).

    ``limit_*``/``remaining_*`` are ``None`` when the tenant has no such limit.
    """

    code = "rate_limit_exceeded"

    def __init__(
        self,
        message: str,
        *,
        reason: str,
        retry_after_s: float,
        limit_requests: int | None = None,
        remaining_requests: int | None = None,
        limit_tokens: int | None = None,
        remaining_tokens: int | None = None,
    ) -> None:
        super().__init__(message)
        self.reason = reason
        self.retry_after_s = retry_after_s
        self.limit_requests = limit_requests
        self.remaining_requests = remaining_requests
        self.limit_tokens = limit_tokens
        self.remaining_tokens = remaining_tokens


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
