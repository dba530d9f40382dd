"""The ``x-ratelimit-*`` headers, as OpenAI sends them: each per-minute limit of a limited
tenant, what is left of it, and how long until it is whole again ("1s", "6m0s", "120ms")."""

from __future__ import annotations

import math

from tenants.rate_limit import SECONDS_PER_MINUTE, RateState


def reset_duration(seconds: float) -> str:
    """``seconds`` as OpenAI's reset headers write a duration (Go's notation, to the
    millisecond): "0s", "120ms", "8.64s", "6m0s", "1h2m3s"."""
    ms = max(0, round(seconds * 1000))
    if ms == 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    hours, rest = divmod(ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    secs = f"{rest / 1000:.3f}".rstrip("0").rstrip(".")
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"


def ratelimit_headers(rate: RateState) -> dict[str, str]:
    """The headers for the limits the tenant has; a limit it does not have sends none."""
    headers: dict[str, str] = {}
    for unit, limit, remaining, reset_s in (
        ("requests", rate.limit_requests, rate.remaining_requests, rate.reset_requests_s),
        ("tokens", rate.limit_tokens, rate.remaining_tokens, rate.reset_tokens_s),
    ):
        if limit is None:
            continue
        headers[f"x-ratelimit-limit-{unit}"] = str(limit)
        if remaining is not None:
            headers[f"x-ratelimit-remaining-{unit}"] = str(remaining)
        if reset_s is not None:
            headers[f"x-ratelimit-reset-{unit}"] = reset_duration(reset_s)
    return headers


def aged(rate: RateState, elapsed_s: float) -> RateState:
    """``rate`` as it stands ``elapsed_s`` seconds later, each bucket refilled meanwhile by
    ``limit / 60`` a second (what others drew since then is not in it)."""
    elapsed_s = max(0.0, elapsed_s)

    def bucket(
        limit: int | None, remaining: int | None, reset_s: float | None
    ) -> tuple[int | None, float | None]:
        if limit is None or remaining is None or reset_s is None or limit <= 0:
            return remaining, reset_s
        left = max(0.0, reset_s - elapsed_s)
        return min(limit, math.floor(limit - left * limit / SECONDS_PER_MINUTE)), left

    remaining_requests, reset_requests_s = bucket(
        rate.limit_requests, rate.remaining_requests, rate.reset_requests_s
    )
    remaining_tokens, reset_tokens_s = bucket(
        rate.limit_tokens, rate.remaining_tokens, rate.reset_tokens_s
    )
    return rate._replace(
        remaining_requests=remaining_requests,
        reset_requests_s=reset_requests_s,
        remaining_tokens=remaining_tokens,
        reset_tokens_s=reset_tokens_s,
    )
