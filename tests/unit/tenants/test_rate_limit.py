"""Token-bucket arithmetic: draining, fitting, remaining and retry times."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tenants.rate_limit import drain, try_draw


def test_draw_until_empty_then_wait_for_refill() -> None:
    drawn = 0.0
    for expected_remaining in (5, 4, 3):
        result = try_draw(drawn, 6, 1)
        assert result.fits and result.remaining == expected_remaining
        drawn = result.drawn
    refused = try_draw(drawn, 6, 4)
    assert not refused.fits and refused.drawn == drawn
    assert refused.retry_after_s == pytest.approx(10.0)  # 1 unit short at 6/min
    assert try_draw(drain(drawn, 6, 10.0), 6, 4).fits


def test_unlimited_and_impossible_draws() -> None:
    assert try_draw(123.0, None, 10**9).fits
    assert drain(50.0, None, 0.0) == 0.0
    assert try_draw(0.0, 10, 11).retry_after_s == 60.0
    assert not try_draw(0.0, 0, 1).fits


@given(st.floats(0, 1e6), st.integers(1, 10**6), st.floats(0, 1e4))
def test_drain_never_goes_negative_or_grows(drawn: float, limit: int, elapsed: float) -> None:
    after = drain(drawn, limit, elapsed)
    assert 0.0 <= after <= drawn
