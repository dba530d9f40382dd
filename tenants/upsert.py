"""Dialect-specific INSERT … ON CONFLICT statements for SQLite and PostgreSQL.

``insert_ignore_stmt`` and ``insert_or_add_stmt`` are built once per dialect and table and run
with the rows as parameters (one or many): request paths insert a row or two per call, and
building the statement each time cost more CPU than running it.
"""

from __future__ import annotations

import functools
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


def insert_or_replace(db: Database, model: type[Base], rows: Rows, keys: Sequence[str]) -> Any:
    """Insert rows; on a key conflict overwrite every other column with the new values."""
    stmt = _insert(db, model, rows)
    return stmt.on_conflict_do_update(
        index_elements=list(keys), set_={name: stmt.excluded[name] for name in _others(model, keys)}
    )


@functools.cache
def _cached_insert(dialect: str, model: type[Base]) -> Any:
    module = postgresql if dialect == "postgresql" else sqlite
    return module.insert(model.__table__)  # type: ignore[attr-defined]


@functools.cache
def insert_ignore_stmt(dialect: str, model: type[Base], returning: str | None = None) -> Any:
    """Insert the rows passed to ``execute``, silently skipping those whose key already exists;
    optionally returning one column of the rows actually inserted."""
    stmt = _cached_insert(dialect, model).on_conflict_do_nothing()
    if returning is not None:
        stmt = stmt.returning(model.__table__.c[returning])  # type: ignore[attr-defined]
    return stmt


@functools.cache
def insert_or_add_stmt(dialect: str, model: type[Base], keys: tuple[str, ...]) -> Any:
    """Insert the rows passed to ``execute``; on a conflict on ``keys`` add every other column
    to the existing row's value."""
    stmt = _cached_insert(dialect, model)
    table = model.__table__  # type: ignore[attr-defined]
    return stmt.on_conflict_do_update(
        index_elements=list(keys),
        set_={name: table.c[name] + stmt.excluded[name] for name in _others(model, keys)},
    )
