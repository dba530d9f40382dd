"""Every error of ours shares one base and carries a stable code the gateway maps once."""

from __future__ import annotations

import pytest

from atrium_errors import AtriumError
from engine.attention.backend import BackendUnavailableError
from engine.device import DeviceUnavailableError
from engine.errors import EngineDeadError, EngineError, InvalidRequestError
from engine.lora.adapter import AdapterError
from tenants.errors import MeterClosedError, MigrationError, QuotaExceededError, TenantError
from tenants.rate_limit import RateState
from web.ops.errors import to_api_error


@pytest.mark.parametrize(
    "error",
    [EngineError, InvalidRequestError, EngineDeadError, TenantError, MeterClosedError],
)
def test_engine_and_tenant_errors_are_atrium_errors_with_their_own_code(
    error: type[Exception],
) -> None:
    assert issubclass(error, AtriumError)
    assert error.code != AtriumError.code  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("exc", "status", "code", "retry"),
    [
        (AdapterError("no such adapter", "model"), 400, "invalid_adapter", False),
        (DeviceUnavailableError("no GPU"), 503, "device_unavailable", True),
        (BackendUnavailableError("no kernels"), 503, "backend_unavailable", True),
        (MeterClosedError("closed"), 503, "meter_closed", False),
        (MigrationError("no scripts"), 500, "migration_error", False),
        (AtriumError("plain"), 500, "atrium_error", False),
    ],
)
def test_a_code_without_its_own_status_takes_its_familys(
    exc: AtriumError, status: int, code: str, retry: bool
) -> None:
    error = to_api_error(exc)
    assert (error.status_code, error.code) == (status, code)
    assert ("Retry-After" in error.headers) is retry
    if status == 500:
        assert "plain" not in error.message and "no scripts" not in error.message


def test_quota_refusals_keep_their_retry_and_limit_headers() -> None:
    exc = QuotaExceededError(
        "slow down", reason="rpm", retry_after_s=2.5, rate=RateState(limit_requests=10)
    )
    error = to_api_error(exc)
    assert error.status_code == 429
    assert error.headers["Retry-After"] == "3"
    assert error.headers["x-ratelimit-limit-requests"] == "10"
