"""Query windows of the admin API: ISO 8601 times read as UTC, ``start`` inclusive, ``end`` not."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from web.ops.errors import bad_request

DEFAULT_SPAN = timedelta(days=30)


def as_utc(value: datetime) -> datetime:
    """Naive times are taken as UTC, as the contract says all times are."""
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def resolve_window(
    start: datetime | None, end: datetime | None, now: datetime | None = None
) -> tuple[datetime, datetime]:
    """``[start, end)``; a missing end is now, a missing start is ``DEFAULT_SPAN`` before end."""
    end_at = as_utc(end) if end is not None else (now or datetime.now(UTC))
    start_at = as_utc(start) if start is not None else end_at - DEFAULT_SPAN
    if end_at <= start_at:
        raise bad_request("end must be after start", "end")
    return start_at, end_at
