"""Writes usage events exactly once (insert-or-ignore on request_id) and their hourly rollups.

Rollups (and the budget charge of events admitted without a reservation) grow only by the events
this very statement inserted, in the same transaction, so a replayed event changes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
from sqlalchemy.ext.asyncio import AsyncSession

from tenants.database import Database
from tenants.models import TokenBudget, UsageEventRow, UsageRollup
from tenants.records import UsageEvent
from tenants.timeutil import hour_floor, month_period
from tenants.upsert import insert_ignore_stmt, insert_or_add_stmt

CHUNK = 200  # rows per INSERT statement (13 parameters each)
ROLLUP_KEYS = ("tenant_id", "model", "hour")
BUDGET_KEYS = ("tenant_id", "period")


def event_row(event: UsageEvent) -> dict[str, Any]:
    """The table's columns of ``event`` (``charge_budget`` is an instruction, not a column)."""
    row = msgspec.structs.asdict(event)
    del row["charge_budget"]
    return row


def budget_charges(events: Sequence[UsageEvent]) -> list[dict[str, Any]]:
    """Tokens per tenant and month (of ``started_at``) of the events that carry no reservation."""
    sums: dict[tuple[str, str], int] = {}
    for event in events:
        if event.charge_budget:
            key = (event.tenant_id, month_period(event.started_at))
            sums[key] = sums.get(key, 0) + event.prompt_tokens + event.completion_tokens
    return [
        {"tenant_id": t, "period": p, "used": used, "reserved": 0}
        for (t, p), used in sorted(sums.items())
    ]


def rollup_rows(events: Sequence[UsageEvent]) -> list[dict[str, Any]]:
    """Hourly sums per tenant and model (bucketed by ``started_at``)."""
    sums: dict[tuple[str, str, Any], list[int]] = {}
    for event in events:
        key = (event.tenant_id, event.model, hour_floor(event.started_at))
        acc = sums.setdefault(key, [0, 0, 0, 0])
        acc[0] += 1
        acc[1] += event.prompt_tokens
        acc[2] += event.cached_tokens
        acc[3] += event.completion_tokens
    return [
        {
            "tenant_id": t,
            "model": m,
            "hour": h,
            "requests": a[0],
            "prompt_tokens": a[1],
            "cached_tokens": a[2],
            "completion_tokens": a[3],
        }
        for (t, m, h), a in sorted(sums.items(), key=lambda item: item[0])
    ]


async def insert_events(
    db: Database, session: AsyncSession, events: Sequence[UsageEvent]
) -> list[UsageEvent]:
    """Insert, inside the caller's transaction, the events not yet stored, with their rollups
    (and budget charges); returns the events that were new."""
    unique = list({e.request_id: e for e in reversed(events)}.values())  # first one wins
    if not unique:
        return []
    inserted: set[str] = set()
    events_stmt = insert_ignore_stmt(db.dialect, UsageEventRow, "request_id")
    for start in range(0, len(unique), CHUNK):
        rows = [event_row(e) for e in unique[start : start + CHUNK]]
        inserted.update((await session.execute(events_stmt, rows)).scalars())
    fresh = [e for e in unique if e.request_id in inserted]
    rollups = rollup_rows(fresh)
    if rollups:
        await session.execute(insert_or_add_stmt(db.dialect, UsageRollup, ROLLUP_KEYS), rollups)
    charges = budget_charges(fresh)
    if charges:
        await session.execute(insert_or_add_stmt(db.dialect, TokenBudget, BUDGET_KEYS), charges)
    return fresh


class UsageStore:
    def __init__(self, db: Database) -> None:
        self._db = db

    async def write(self, events: Sequence[UsageEvent]) -> int:
        """Insert the events not yet stored; returns how many were new."""
        if not events:
            return 0
        async with self._db.transaction() as session:
            return len(await insert_events(self._db, session, events))
