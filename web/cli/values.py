"""Argument types of the admin commands: durations (``90s``, ``15m``, ``1h``, ``7d``), ISO 8601
times (naive ones read as UTC, as the admin API reads them) and limits that ``none`` clears."""

from __future__ import annotations

import argparse
from datetime import UTC, datetime, timedelta

UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
DEFAULT_SPAN = timedelta(days=30)  # the admin API's default window


def duration(text: str) -> timedelta:
    """``1h``, ``30m``, ``7d``, ``45s``, ``2w`` or plain seconds."""
    value = text.strip().lower()
    unit = value[-1:] if value[-1:] in UNITS else "s"
    number = value[:-1] if value[-1:] in UNITS else value
    try:
        amount = float(number)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a duration: {text!r} (use 90s, 15m, 1h, 7d)"
        ) from None
    if amount < 0:
        raise argparse.ArgumentTypeError(f"a duration cannot be negative: {text!r}")
    return timedelta(seconds=amount * UNITS[unit])


def instant(text: str) -> datetime:
    """An ISO 8601 time; without a zone it is UTC."""
    try:
        value = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an ISO 8601 time: {text!r}") from None
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def count_or_none(text: str) -> int | None:
    """A non-negative integer, or ``none`` (unlimited)."""
    if text.strip().lower() in {"none", "null", "unlimited"}:
        return None
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number or 'none': {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative: {text!r}")
    return value


def share_or_none(text: str) -> float | None:
    if text.strip().lower() in {"none", "null", "unlimited"}:
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number or 'none': {text!r}") from None


def names(text: str) -> list[str]:
    """A comma-separated list (``a,b``)."""
    return [part.strip() for part in text.split(",") if part.strip()]


def window(start: datetime | None, end: datetime | None) -> tuple[datetime, datetime]:
    """``[start, end)``: a missing end is now, a missing start 30 days before the end."""
    end_at = end or datetime.now(UTC)
    return start or end_at - DEFAULT_SPAN, end_at


def window_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--start", type=instant, help="ISO 8601, inclusive (default: end - 30d)")
    parser.add_argument("--end", type=instant, help="ISO 8601, exclusive (default: now)")


def model_list_or_all(text: str) -> list[str] | None:
    """Comma-separated model names, or ``all`` (every model)."""
    if text.strip().lower() in {"all", "none", "null"}:
        return None
    names = [name.strip() for name in text.split(",")]
    if not all(names):
        raise argparse.ArgumentTypeError(f"not a comma-separated list of models: {text!r}")
    return names
