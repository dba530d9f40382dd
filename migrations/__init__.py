"""Alembic environment and versions for the ``tenants`` models (scripts dir = this folder)."""

from __future__ import annotations

from pathlib import Path

from alembic.config import Config

SCRIPT_DIR = Path(__file__).resolve().parent


def alembic_config(url: str | None = None) -> Config:
    """A programmatic Alembic config for this package, usable from a checkout or a wheel."""
    cfg = Config()
    cfg.set_main_option("script_location", str(SCRIPT_DIR))
    if url is not None:
        cfg.set_main_option("sqlalchemy.url", url)
    return cfg
