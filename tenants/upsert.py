"""Dialect-specific INSERT … ON CONFLICT statements for SQLite and PostgreSQL."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy.dialects import postgresql, sqlite

from tenants.database import Database
from tenants.models import Base

Rows = Sequence[dict[str, Any]]


def _insert(db: Database, model: type[Base], rows: Rows) -> Any:
    module = postgresql if db.dialect == "postgresql" else sqlite
    return module.insert(model).values(list(rows))


def _others(model: type[Base], keys: Sequence[str]) -> list[str]:
    """The model's columns outside ``keys``."""
    return [c.name for c in model.__table__.columns if c.name not in keys]  # type: ignore[attr-defined]


def insert_ignore(db: Database, model: type[Base], rows: Rows) -> Any:
    """Insert rows, silently skipping those whose primary key already exists."""
    return _insert(db, model, rows).on_conflict_do_nothing()


def insert_or_add(db: Database, model: type[Base], rows: Rows, keys: Sequence[str]) -> Any:
    """Insert rows; on a key conflict add every other column to the existing row's value."""
    stmt = _insert(db, model, rows)
    table = model.__table__
    return stmt.on_conflict_do_update(
        index_elements=list(keys),
        set_={name: table.c[name] + stmt.excluded[name] for name in _others(model, keys)},  # type: ignore[attr-defined]
    )


def insert_or_replace(db: Database, model: type[Base], rows: Rows, keys: Sequence[str]) -> Any:
    """Insert rows; on a key conflict overwrite every other column with the new values."""
    stmt = _insert(db, model, rows)
    return stmt.on_conflict_do_update(
        index_elements=list(keys), set_={name: stmt.excluded[name] for name in _others(model, keys)}
    )
