"""Writes usage events exactly once (insert-or-ignore on request_id) and their hourly rollups.

Rollups grow only by the events this very statement inserted, in the same transaction, so a
replayed event changes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from tenants.database import Database
from tenants.models import UsageEventRow, UsageRollup
from tenants.records import UsageEvent
from tenants.timeutil import hour_floor
from tenants.upsert import insert_ignore, insert_or_add

CHUNK = 200  # rows per INSERT statement (13 parameters each)
ROLLUP_KEYS = ("tenant_id", "model", "hour")


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


class UsageStore:
    def __init__(self, db: Database) -> None:
        self._db = db

    async def write(self, events: Sequence[UsageEvent]) -> int:
        """Insert the events not yet stored; returns how many were new."""
        unique = list({e.request_id: e for e in reversed(events)}.values())  # first one wins
        if not unique:
            return 0
        inserted: set[str] = set()
        async with self._db.transaction() as session:
            for start in range(0, len(unique), CHUNK):
                rows = [msgspec.structs.asdict(e) for e in unique[start : start + CHUNK]]
                stmt = insert_ignore(self._db, UsageEventRow, rows).returning(
                    UsageEventRow.request_id
                )
                inserted.update((await session.execute(stmt)).scalars())
            fresh = [e for e in unique if e.request_id in inserted]
            rollups = rollup_rows(fresh)
            if rollups:
                await session.execute(insert_or_add(self._db, UsageRollup, rollups, ROLLUP_KEYS))
        return len(fresh)
