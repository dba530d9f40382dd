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
