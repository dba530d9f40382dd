"""Admission without the database: each in-process refusal is reached, slots come back once."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from tenants.errors import (
    DuplicateRequestError,
    LimitUnreachableError,
    PromptTooLargeError,
    QuotaExceededError,
)
from tenants.schemas import AuthContext, Quotas
from web.tenancy.db_monitor import DegradedMetrics
from web.tenancy.degraded import LocalAdmission


class Clock:
    def __init__(self) -> None:
        self.t = 50.0

    def __call__(self) -> float:
        return self.t


def ctx(tenant_id: str = "tn_a", **quotas: int) -> AuthContext:
    return AuthContext(
        tenant_id=tenant_id,
        tenant_name=tenant_id,
        key_id=f"key_{tenant_id}",
        weight=1.0,
        status="active",
        quotas=Quotas(**quotas),
    )


def local() -> tuple[LocalAdmission, Clock, DegradedMetrics]:
    clock = Clock()
    metrics = DegradedMetrics(CollectorRegistry())
    return LocalAdmission(metrics, monotonic=clock), clock, metrics


def test_a_prompt_over_the_tenants_limit_is_refused_before_anything_is_drawn() -> None:
    admission, _, metrics = local()
    with pytest.raises(PromptTooLargeError) as refused:
        admission.admit(ctx(max_prompt_tokens=100), "r1", 101, 10, outage=1)
    assert (refused.value.limit, refused.value.prompt_tokens) == (100, 101)
    assert admission.in_flight("tn_a") == 0
    assert metrics.degraded_admissions._value.get() == 0
    admission.admit(ctx(max_prompt_tokens=100), "r2", 100, 10, outage=1)
    assert metrics.degraded_admissions._value.get() == 1


def test_the_same_request_id_is_admitted_once_until_released() -> None:
    admission, _, _ = local()
    ticket = admission.admit(ctx(), "r1", 10, 10, outage=1)
    with pytest.raises(DuplicateRequestError):
        admission.admit(ctx(), "r1", 10, 10, outage=1)
    assert admission.release(ticket, 20) is True
    assert admission.release(ticket, 20) is False  # idempotent: the slot came back once
    assert admission.in_flight("tn_a") == 0


def test_concurrency_cap_refuses_the_next_and_a_release_lets_it_in() -> None:
    admission, _, _ = local()
    tenant = ctx(max_concurrent_requests=2)
    tickets = [admission.admit(tenant, f"r{i}", 5, 5, outage=1) for i in range(2)]
    with pytest.raises(QuotaExceededError) as refused:
        admission.admit(tenant, "r2", 5, 5, outage=1)
    assert refused.value.reason == "max_concurrent_requests"
    assert refused.value.retry_after_s > 0
    # Another tenant is not held back by this one's slots.
    admission.admit(ctx("tn_b", max_concurrent_requests=2), "b1", 5, 5, outage=1)
    admission.release(tickets[0], 10)
    admission.admit(tenant, "r2", 5, 5, outage=1)
    assert admission.in_flight("tn_a") == 2


def test_requests_per_minute_refuses_with_a_retry_and_refills_with_time() -> None:
    admission, clock, _ = local()
    tenant = ctx(requests_per_minute=3)
    for i in range(3):
        admission.release(admission.admit(tenant, f"r{i}", 1, 1, outage=1), 2)
    with pytest.raises(QuotaExceededError) as refused:
        admission.admit(tenant, "r3", 1, 1, outage=1)
    assert refused.value.reason == "requests_per_minute"
    assert refused.value.retry_after_s == pytest.approx(20.0)
    assert (refused.value.limit_requests, refused.value.remaining_requests) == (3, 0)
    clock.t += 20.0
    ticket = admission.admit(tenant, "r3", 1, 1, outage=1)
    assert ticket.limit_requests == 3 and ticket.remaining_requests == 0


def test_tokens_per_minute_counts_prompt_and_max_tokens_and_refunds_unused() -> None:
    admission, _, _ = local()
    tenant = ctx(tokens_per_minute=1000)
    first = admission.admit(tenant, "r1", 300, 500, outage=1)  # 800 drawn
    assert first.remaining_tokens == 200
    with pytest.raises(QuotaExceededError) as refused:
        admission.admit(tenant, "r2", 100, 200, outage=1)
    assert refused.value.reason == "tokens_per_minute"
    assert refused.value.remaining_tokens == 200
    admission.release(first, 350)  # used 350 of the 800: 450 come back
    second = admission.admit(tenant, "r2", 100, 200, outage=1)
    assert second.remaining_tokens == 1000 - 350 - 300


def test_a_request_larger_than_a_minutes_tokens_is_refused_for_good() -> None:
    admission, _, _ = local()
    with pytest.raises(LimitUnreachableError) as refused:
        admission.admit(ctx(tokens_per_minute=100), "r1", 90, 20, outage=1)
    assert (refused.value.reason, refused.value.limit, refused.value.requested) == (
        "tokens_per_minute",
        100,
        110,
    )
    assert admission.in_flight("tn_a") == 0


def test_unlimited_quotas_admit_and_report_no_limits() -> None:
    admission, _, _ = local()
    ticket = admission.admit(ctx(), "r1", 10_000, 10_000, outage=3, ambiguous=True)
    assert ticket.ambiguous and ticket.reserved_tokens == 20_000
    assert (ticket.limit_requests, ticket.limit_tokens, ticket.remaining_tokens) == (
        None,
        None,
        None,
    )


def test_a_budget_never_seen_through_the_database_is_refused_rather_than_overspent() -> None:
    admission, _, _ = local()
    with pytest.raises(QuotaExceededError) as refused:
        admission.admit(ctx(monthly_token_budget=300), "r1", 10, 10, outage=1)
    assert refused.value.reason == "monthly_token_budget"
    assert admission.in_flight("tn_a") == 0
    # A tenant without a budget is not held back by this.
    admission.admit(ctx("tn_b"), "b1", 10, 10, outage=1)


def test_the_last_known_budget_bounds_what_an_outage_may_spend() -> None:
    """The finding: a 300-token budget spent 415 while degraded. Now at most what was left."""
    admission, _, _ = local()
    tenant = ctx(monthly_token_budget=300)
    admission.note_budget("tn_a", 120)  # the database's last admission left 120
    first = admission.admit(tenant, "r1", 40, 60, outage=1)  # 100 reserved: 20 left
    with pytest.raises(QuotaExceededError) as refused:
        admission.admit(tenant, "r2", 10, 20, outage=1)
    assert refused.value.reason == "monthly_token_budget"
    assert "20 tokens left" in str(refused.value) and "needs up to 30" in str(refused.value)
    admission.release(first, 70)  # used 70 of the 100: 30 come back, 50 left
    assert admission.budget_left("tn_a") == 50
    admission.admit(tenant, "r2", 10, 20, outage=1)
    assert admission.budget_left("tn_a") == 20
    admission.note_budget("tn_a", None)  # the budget was lifted
    assert admission.budget_left("tn_a") is None
