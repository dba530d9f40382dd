"""Failed authentications per address: a sliding minute, 429 past the limit, bounded memory."""

from __future__ import annotations

import pytest

from web.ops.errors import ApiError
from web.tenancy.auth_limiter import WINDOW_S, FailedAuthLimiter


def test_an_address_over_its_limit_waits_for_its_oldest_failure_to_age_out() -> None:
    now = [100.0]
    limiter = FailedAuthLimiter(3, monotonic=lambda: now[0])
    for step in range(3):
        assert limiter.retry_after_s("10.0.0.1") is None
        limiter.record_failure("10.0.0.1")
        now[0] += 1.0 if step < 2 else 0.0
    assert limiter.retry_after_s("10.0.0.1") == pytest.approx(WINDOW_S - 2.0)
    assert limiter.retry_after_s("10.0.0.2") is None  # other addresses are not held up
    with pytest.raises(ApiError) as refused:
        limiter.check("10.0.0.1")
    assert refused.value.status_code == 429 and refused.value.code == "too_many_failed_attempts"
    assert int(refused.value.headers["Retry-After"]) == 58
    now[0] = 100.0 + WINDOW_S  # the first failure ages out: one more try is allowed
    assert limiter.retry_after_s("10.0.0.1") is None
    limiter.check("10.0.0.1")


def test_zero_turns_it_off_and_addresses_are_bounded() -> None:
    off = FailedAuthLimiter(0)
    for _ in range(100):
        off.record_failure("a")
    assert off.retry_after_s("a") is None
    limiter = FailedAuthLimiter(1, max_addresses=2)
    for address in ("a", "b", "c"):
        limiter.record_failure(address)
    assert limiter.retry_after_s("a") is None  # forgotten first: the oldest address
    assert limiter.retry_after_s("b") is not None and limiter.retry_after_s("c") is not None
