"""Admission's refusals, worded once: which limit, whose (the key's or the tenant's), what is
left of it and when it frees up, so that a client can act on the message alone."""

from __future__ import annotations

import math
from datetime import UTC, datetime

from tenants.errors import BudgetExhaustedError, LimitUnreachableError, QuotaExceededError
from tenants.rate_limit import Draw, RateState
from tenants.schemas import Quotas

MICROS = 1_000_000  # money is counted in micro-units of the price table's currency


def whose(scope: str, name: str) -> str:
    return f"the API key {name}" if scope == "key" else f'the tenant "{name}"'


def in_seconds(seconds: float) -> str:
    """A wait as a client reads it: whole seconds, rounded up, at least one."""
    return f"{max(1, math.ceil(seconds))}s"


def money(micros: int) -> str:
    """Micro-units as a decimal amount with six places (exact, whatever its size)."""
    sign = "-" if micros < 0 else ""
    whole, fraction = divmod(abs(micros), MICROS)
    return f"{sign}{whole}.{fraction:06d}"


def utc_iso(at: datetime) -> str:
    return at.astimezone(UTC).isoformat().replace("+00:00", "Z")


def rate_limited(
    *,
    reason: str,
    per_minute: str,
    scope: str,
    name: str,
    limit: int,
    remaining: int,
    requested: int,
    retry_after_s: float,
    rate: RateState,
) -> QuotaExceededError:
    """A requests or tokens per minute limit (``per_minute``: "requests" or "tokens") refused
    ``requested`` of them; the bucket refills in ``retry_after_s`` enough for it."""
    label = "requests per minute (RPM)" if per_minute == "requests" else "tokens per minute (TPM)"
    message = (
        f"Rate limit reached for {label} of {whose(scope, name)}: limit {limit}, "
        f"used {max(0, limit - remaining)}, requested {requested}. "
        f"Please try again in {in_seconds(retry_after_s)}."
    )
    return QuotaExceededError(
        message, reason=reason, retry_after_s=retry_after_s, scope=scope, rate=rate
    )


def tenant_rate_limited(
    *,
    name: str,
    rpm: int | None,
    requests: Draw,
    tpm: int | None,
    tokens: Draw,
    need: int,
    rate: RateState,
) -> QuotaExceededError:
    """The tenant's requests per minute (named first) or tokens per minute refused ``need``
    tokens; the retry waits for both."""
    by_requests = not requests.fits
    return rate_limited(
        reason="requests_per_minute" if by_requests else "tokens_per_minute",
        per_minute="requests" if by_requests else "tokens",
        scope="tenant",
        name=name,
        limit=(rpm if by_requests else tpm) or 0,
        remaining=requests.remaining if by_requests else tokens.remaining,
        requested=1 if by_requests else need,
        retry_after_s=max(requests.retry_after_s, tokens.retry_after_s),
        rate=rate,
    )


def too_many_running(
    *, reason: str, name: str, cap: int, running: int, retry_after_s: float, rate: RateState
) -> QuotaExceededError:
    message = (
        f"Concurrency limit reached for {whose('tenant', name)}: limit {cap} requests at once, "
        f"{running} running. Please try again in {in_seconds(retry_after_s)}."
    )
    return QuotaExceededError(message, reason=reason, retry_after_s=retry_after_s, rate=rate)


def budget_exhausted(
    *,
    cost: bool,
    name: str,
    budget: int,
    spent: int,
    need: int,
    resets_at: datetime,
    now: datetime,
    rate: RateState,
) -> BudgetExhaustedError:
    """The month's token budget (or, with ``cost``, its budget in money) cannot cover ``need``
    until ``resets_at``."""
    left = max(0, budget - spent)
    if cost:
        what = f"monthly cost budget of {whose('tenant', name)} is {money(budget)}"
        state = f"{money(left)} is left and this request may cost up to {money(need)}"
    else:
        what = f"monthly token budget of {whose('tenant', name)} is {budget} tokens"
        state = f"{left} are left and this request needs up to {need} (prompt and max_tokens)"
    message = (
        f"You exceeded your current quota: the {what}; {state}. "
        f"The budget resets at {utc_iso(resets_at)}."
    )
    return BudgetExhaustedError(
        message,
        reason="monthly_cost_budget" if cost else "monthly_token_budget",
        budget=budget,
        remaining=left,
        resets_at=resets_at,
        retry_after_s=max(0.0, (resets_at - now).total_seconds()),
        rate=rate,
    )


def never_fits(
    *,
    reason: str,
    scope: str,
    name: str,
    limit: int,
    prompt_tokens: int,
    max_tokens: int,
    cost: int | None = None,
    rate: RateState,
) -> LimitUnreachableError:
    """The request alone is above ``limit`` (tokens, or money with ``cost``): no wait helps."""
    labels = {
        "tokens_per_minute": "tokens per minute (TPM) limit",
        "monthly_token_budget": "monthly token budget",
        "monthly_cost_budget": "monthly cost budget",
    }
    of = f"the {labels[reason]} of {whose(scope, name)}"
    if cost is None:
        need = prompt_tokens + max_tokens
        asked = (
            f"This request needs up to {need} tokens (a prompt of {prompt_tokens} and up to "
            f"{max_tokens} generated), more than {of} ({limit})"
        )
    else:
        need = cost
        asked = f"This request may cost up to {money(cost)}, more than {of} ({money(limit)})"
    return LimitUnreachableError(
        f"{asked}: it can never be admitted. Lower max_tokens or shorten the prompt.",
        reason=reason,
        limit=limit,
        requested=need,
        rate=rate,
    )


def check_reachable(
    quotas: Quotas,
    *,
    name: str,
    prompt_tokens: int,
    max_tokens: int,
    cost: int,
    rate: RateState,
) -> None:
    """Refuse a request that asks for more than a limit ever allows (a 400, not a 429: waiting
    cannot help): prompt and ``max_tokens`` above the tokens per minute or the monthly token
    budget, or a worst-case ``cost`` above the monthly cost budget."""
    need = prompt_tokens + max_tokens
    for reason, limit in (
        ("tokens_per_minute", quotas.tokens_per_minute),
        ("monthly_token_budget", quotas.monthly_token_budget),
    ):
        if limit is not None and need > limit:
            raise never_fits(
                reason=reason,
                scope="tenant",
                name=name,
                limit=limit,
                prompt_tokens=prompt_tokens,
                max_tokens=max_tokens,
                rate=rate,
            )
    budget = quotas.monthly_cost_budget
    if budget is not None and cost > budget:
        raise never_fits(
            reason="monthly_cost_budget",
            scope="tenant",
            name=name,
            limit=budget,
            prompt_tokens=prompt_tokens,
            max_tokens=max_tokens,
            cost=cost,
            rate=rate,
        )
