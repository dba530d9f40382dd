"""Usage over a window from the hourly rollups, per tenant, by hour or by day (UTC)."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import func, select

from tenants.database import Database
from tenants.models import UsageRollup
from tenants.records import Granularity, UsageBucket
from tenants.timeutil import check_window, day_floor


class UsageReport:
    def __init__(self, db: Database) -> None:
        self._db = db

    async def usage(
        self,
        start: datetime,
        end: datetime,
        granularity: Granularity = "hour",
        tenant_id: str | None = None,
    ) -> list[UsageBucket]:
        """Buckets of hours starting in ``[start, end)``, ordered by tenant then start.

        Buckets with no requests are left out.
        """
        start, end = check_window(start, end)
        stmt = (
            select(
                UsageRollup.tenant_id,
                UsageRollup.hour,
                func.sum(UsageRollup.requests),
                func.sum(UsageRollup.prompt_tokens),
                func.sum(UsageRollup.cached_tokens),
                func.sum(UsageRollup.completion_tokens),
            )
            .where(UsageRollup.hour >= start, UsageRollup.hour < end)
            .group_by(UsageRollup.tenant_id, UsageRollup.hour)
        )
        if tenant_id is not None:
            stmt = stmt.where(UsageRollup.tenant_id == tenant_id)
        async with self._db.sessions() as session:
            rows = (await session.execute(stmt)).all()
        sums: dict[tuple[str, datetime], list[int]] = {}
        for tenant, hour, requests, prompt, cached, completion in rows:
            bucket = hour if granularity == "hour" else day_floor(hour)
            acc = sums.setdefault((tenant, bucket), [0, 0, 0, 0])
            for i, value in enumerate((requests, prompt, cached, completion)):
                acc[i] += int(value)
        return [
            UsageBucket(
                tenant_id=tenant,
                start=bucket,
                requests=acc[0],
                prompt_tokens=acc[1],
                cached_tokens=acc[2],
                completion_tokens=acc[3],
            )
            for (tenant, bucket), acc in sorted(sums.items())
        ]
