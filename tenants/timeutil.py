"""UTC clock helpers: the injectable clock type, month periods and hour/day buckets."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta

from tenants.errors import InvalidInputError

Clock = Callable[[], datetime]


def utc_now() -> datetime:
    return datetime.now(UTC)


def aware(value: datetime, param: str) -> datetime:
    """``value`` in UTC; naive datetimes are refused rather than guessed."""
    if value.tzinfo is None:
        raise InvalidInputError(f"{param} must carry a timezone (ISO 8601 with Z or offset)", param)
    return value.astimezone(UTC)


def month_period(at: datetime) -> str:
    """The budget period containing ``at``: ``YYYY-MM`` in UTC."""
    return at.astimezone(UTC).strftime("%Y-%m")


def next_month_start(at: datetime) -> datetime:
    at = at.astimezone(UTC)
    year, month = (at.year + 1, 1) if at.month == 12 else (at.year, at.month + 1)
    return datetime(year, month, 1, tzinfo=UTC)


def hour_floor(at: datetime) -> datetime:
    return at.astimezone(UTC).replace(minute=0, second=0, microsecond=0)


def day_floor(at: datetime) -> datetime:
    return hour_floor(at).replace(hour=0)


def check_window(start: datetime, end: datetime) -> tuple[datetime, datetime]:
    start, end = aware(start, "start"), aware(end, "end")
    if end <= start:
        raise InvalidInputError("end must be after start", "end")
    if end - start > timedelta(days=3660):
        raise InvalidInputError("window longer than ten years", "end")
    return start, end
