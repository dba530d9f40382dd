"""The audit log: every admin mutation is written in its own transaction, read oldest first."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import msgspec
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from tenants.database import Database
from tenants.models import AuditEntry
from tenants.records import AuditRecord
from tenants.timeutil import check_window


def snapshot(value: msgspec.Struct | None) -> dict[str, Any] | None:
    """A JSON-ready copy of a returned struct, as stored in ``before``/``after``."""
    if value is None:
        return None
    result = msgspec.to_builtins(value)
    if not isinstance(result, dict):
        raise TypeError("audit snapshots must be structs")
    return result


def add_entry(
    session: AsyncSession,
    *,
    at: datetime,
    actor: str,
    action: str,
    target: str,
    before: msgspec.Struct | None,
    after: msgspec.Struct | None,
) -> None:
    """Add an audit row to ``session``: it commits or rolls back with the mutation itself."""
    session.add(
        AuditEntry(
            at=at,
            actor=actor,
            action=action,
            target=target,
            before=snapshot(before),
            after=snapshot(after),
        )
    )


class AuditService:
    def __init__(self, db: Database) -> None:
        self._db = db

    async def record(
        self,
        *,
        actor: str,
        action: str,
        target: str,
        before: msgspec.Struct | None = None,
        after: msgspec.Struct | None = None,
        at: datetime | None = None,
    ) -> None:
        """Append an audit row for a mutation made elsewhere (e.g. in the engine)."""
        async with self._db.transaction() as session:
            add_entry(
                session,
                at=at or datetime.now(UTC),
                actor=actor,
                action=action,
                target=target,
                before=before,
                after=after,
            )

    async def entries(
        self, start: datetime, end: datetime, limit: int = 10_000
    ) -> list[AuditRecord]:
        """Audit rows with ``start <= at < end``, oldest first."""
        start, end = check_window(start, end)
        async with self._db.sessions() as session:
            rows = await session.scalars(
                select(AuditEntry)
                .where(AuditEntry.at >= start, AuditEntry.at < end)
                .order_by(AuditEntry.at, AuditEntry.id)
                .limit(limit)
            )
            return [
                AuditRecord(
                    id=row.id,
                    at=row.at,
                    actor=row.actor,
                    action=row.action,
                    target=row.target,
                    before=row.before,
                    after=row.after,
                )
                for row in rows
            ]
