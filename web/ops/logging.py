"""structlog as JSON lines, configured once per entry point; context variables carry request ids."""

from __future__ import annotations

import io
import logging
import sys
from typing import TextIO, cast

import structlog

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING}


class StderrNow(io.TextIOBase):
    """Whatever ``sys.stderr`` is at each write, not what it was when logging was configured
    (test runners and tools swap it, and a swapped-out stream may be closed by then)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def stderr_now() -> TextIO:
    return cast(TextIO, StderrNow())


def configure_logging(level: str = "info", stream: TextIO | None = None) -> None:
    """One JSON object per line on ``stream`` (stderr by default), with bound context merged in."""
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(LEVELS.get(level, logging.INFO)),
        logger_factory=structlog.PrintLoggerFactory(stream or stderr_now()),
        cache_logger_on_first_use=True,
    )
