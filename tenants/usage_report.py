"""Usage over a window from the hourly rollups, per tenant, by hour or by day (UTC).

The database sums each bucket, in (tenant, hour) order off the covering index
``ix_usage_rollups_tenant_id_hour``; Python only turns the rows into buckets.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import ColumnElement, func, select, type_coerce
from sqlalchemy.types import NullType

from tenants.database import Database
from tenants.models import UsageRollup
from tenants.records import Granularity, UsageBucket
from tenants.timeutil import check_window

R = UsageRollup
# SQLite keeps datetimes as ISO text ``YYYY-MM-DD HH:MM:SS.ffffff``: a day is its first 10 chars.
SQLITE_DAY_CHARS = 10


def bucket_start(dialect: str, granularity: Granularity) -> ColumnElement[Any]:
    """The start of the bucket a rollup hour falls in, as the driver's raw value."""
    if granularity == "hour":
        return type_coerce(R.hour, NullType())  # raw: parsed once per bucket by ``as_utc``
    if granularity != "day":
        raise ValueError(f"unknown granularity {granularity!r}")
    if dialect == "postgresql":
        return func.date_trunc("day", R.hour)
    return func.substr(R.hour, 1, SQLITE_DAY_CHARS)


def as_utc(value: datetime | str) -> datetime:
    """A naive UTC value from either driver (a datetime, or SQLite's ISO text) made aware."""
    if isinstance(value, str):
        value = datetime.fromisoformat(value)
    return value.replace(tzinfo=UTC)


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
        bucket = bucket_start(self._db.dialect, granularity).label("bucket")
        where = [R.hour >= start, R.hour < end]
        if tenant_id is not None:
            where.append(R.tenant_id == tenant_id)
        stmt = (
            select(
                R.tenant_id,
                bucket,
                func.sum(R.requests),
                func.sum(R.prompt_tokens),
                func.sum(R.cached_tokens),
                func.sum(R.completion_tokens),
            )
            .where(*where)
            .group_by(R.tenant_id, bucket)
            .order_by(R.tenant_id, bucket)
        )
        async with self._db.engine.connect() as conn:
            rows = (await conn.execute(stmt)).all()
        starts: dict[datetime | str, datetime] = {}  # every tenant shares the same few starts
        # PostgreSQL sums bigints as numeric: int() turns its Decimals back into ints.
        return [
            UsageBucket(
                tenant_id=tenant,
                start=starts.get(at) or starts.setdefault(at, as_utc(at)),
                requests=int(requests),
                prompt_tokens=int(prompt),
                cached_tokens=int(cached),
                completion_tokens=int(completion),
            )
            for tenant, at, requests, prompt, cached, completion in rows
            if requests
        ]
