"""Flags with ``ATRIUM_*`` environment twins, and the exit status of a usage error."""

from __future__ import annotations

import os

EXIT_USAGE = 2


def env_default(name: str, default: str | None = None) -> str | None:
    """The default of a flag: its ``ATRIUM_*`` environment twin when set."""
    value = os.environ.get(name)
    return default if value is None or value == "" else value


def env_flag(name: str) -> bool:
    return (os.environ.get(name) or "").strip().lower() in {"1", "true", "yes", "on"}
