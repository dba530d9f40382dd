"""Per-minute token-bucket arithmetic (pure): draining what was drawn and when a draw fits.

A bucket of capacity ``limit`` refills at ``limit / 60`` per second; ``drawn`` is what was
taken and has not yet refilled, so ``limit - drawn`` is available now.
"""

from __future__ import annotations

import math
from typing import NamedTuple

SECONDS_PER_MINUTE = 60.0


class Draw(NamedTuple):
    """The outcome of trying to take ``amount`` from a bucket."""

    fits: bool
    drawn: float  # what is drawn after this attempt (unchanged when it does not fit)
    remaining: int  # whole units left after this attempt
    retry_after_s: float  # 0 when it fits


def drain(drawn: float, limit: int | None, elapsed_s: float) -> float:
    """What is still drawn after ``elapsed_s`` seconds of refill (never negative)."""
    if limit is None:
        return 0.0
    return max(0.0, drawn - max(0.0, elapsed_s) * limit / SECONDS_PER_MINUTE)


def try_draw(drawn: float, limit: int | None, amount: int) -> Draw:
    """Take ``amount`` if it fits under ``limit`` (``None``: unlimited, always fits)."""
    if limit is None:
        return Draw(True, 0.0, 0, 0.0)
    if drawn + amount <= limit:
        after = drawn + amount
        return Draw(True, after, math.floor(limit - after), 0.0)
    remaining = max(0, math.floor(limit - drawn))
    if amount > limit or limit == 0:
        return Draw(False, drawn, remaining, SECONDS_PER_MINUTE)  # never fits in one minute
    wait = (drawn + amount - limit) * SECONDS_PER_MINUTE / limit
    return Draw(False, drawn, remaining, wait)


class RateState(NamedTuple):
    """The per-minute limits as a response reports them (``x-ratelimit-*``): each limit, what
    is left of it, and the seconds until its bucket is full again; None: no such limit."""

    limit_requests: int | None = None
    remaining_requests: int | None = None
    reset_requests_s: float | None = None
    limit_tokens: int | None = None
    remaining_tokens: int | None = None
    reset_tokens_s: float | None = None


NO_LIMITS = RateState()  # a tenant without per-minute limits reports none


def refill_s(draw: Draw, limit: int | None) -> float | None:
    """Seconds until a bucket holding ``draw.drawn`` has refilled to ``limit`` (None: no limit)."""
    if limit is None:
        return None
    if limit == 0:
        return 0.0
    return draw.drawn * SECONDS_PER_MINUTE / limit


def rate_state(rpm: int | None, requests: Draw, tpm: int | None, tokens: Draw) -> RateState:
    """What the tenant's requests and tokens buckets report after ``requests`` and ``tokens``
    were tried (drawn when they fit, untouched when not)."""
    return RateState(
        limit_requests=rpm,
        remaining_requests=None if rpm is None else requests.remaining,
        reset_requests_s=refill_s(requests, rpm),
        limit_tokens=tpm,
        remaining_tokens=None if tpm is None else tokens.remaining,
        reset_tokens_s=refill_s(tokens, tpm),
    )


class RateView:
    """The per-minute limits of a ``rate`` attribute as plain properties, for what carries one
    (an admission ticket, a quota refusal)."""

    __slots__ = ()
    rate: RateState

    @property
    def limit_requests(self) -> int | None:
        return self.rate.limit_requests

    @property
    def remaining_requests(self) -> int | None:
        return self.rate.remaining_requests

    @property
    def limit_tokens(self) -> int | None:
        return self.rate.limit_tokens

    @property
    def remaining_tokens(self) -> int | None:
        return self.rate.remaining_tokens
