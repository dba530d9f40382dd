"""Usage over a window from the hourly rollups, per tenant, by hour or by day (UTC).

The database sums each bucket off a covering index (migration 0002); Python only sorts the rows
by tenant and turns them into buckets.
"""

from __future__ import annotations

from datetime import UTC, datetime
from operator import itemgetter
from typing import Any

from sqlalchemy import BigInteger, ColumnElement, cast, func, select, type_coerce
from sqlalchemy.orm import InstrumentedAttribute
from sqlalchemy.types import NullType

from tenants.database import Database
from tenants.models import Tenant, UsageRollup
from tenants.records import Granularity, ModelUsageBucket, UsageBucket
from tenants.timeutil import check_window

R = UsageRollup
# SQLite keeps datetimes as ISO text ``YYYY-MM-DD HH:MM:SS.ffffff``: a day is its first 10 chars.
SQLITE_DAY_CHARS = 10
BY_TENANT = itemgetter(0)  # a stable sort keeps each tenant's buckets in time order
SUMS = (R.requests, R.prompt_tokens, R.cached_tokens, R.completion_tokens)


def bucket_start(dialect: str, granularity: Granularity) -> ColumnElement[Any]:
    """The start of the bucket a rollup hour falls in, as the driver's raw value."""
    if granularity == "hour":
        return type_coerce(R.hour, NullType())  # raw: parsed once per bucket by ``as_utc``
    if granularity != "day":
        raise ValueError(f"unknown granularity {granularity!r}")
    if dialect == "postgresql":
        return func.date_trunc("day", R.hour)
    return func.substr(R.hour, 1, SQLITE_DAY_CHARS)


def _total(column: InstrumentedAttribute[int]) -> ColumnElement[int]:
    # PostgreSQL sums bigints as numeric, which the driver would decode into Decimals (slowly);
    # a month of hourly sums fits a bigint many times over.
    return cast(func.sum(column), BigInteger)


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
            select(R.tenant_id, bucket, *(_total(column) for column in SUMS))
            .where(*where)
            # Index order (hour, then tenant): the database streams the groups, no hash or sort.
            .group_by(bucket, R.tenant_id)
            .order_by(bucket, R.tenant_id)
        )
        async with self._db.engine.connect() as conn:
            rows = (await conn.execute(stmt)).all()
        starts: dict[datetime | str, datetime] = {}  # every tenant shares the same few starts
        return [
            UsageBucket(
                tenant_id=tenant,
                start=starts.get(at) or starts.setdefault(at, as_utc(at)),
                requests=requests,
                prompt_tokens=prompt,
                cached_tokens=cached,
                completion_tokens=completion,
            )
            for tenant, at, requests, prompt, cached, completion in sorted(rows, key=BY_TENANT)
            if requests
        ]

    async def usage_by_model(
        self,
        start: datetime,
        end: datetime,
        granularity: Granularity = "hour",
        tenant_id: str | None = None,
    ) -> list[ModelUsageBucket]:
        """``usage`` split by model, with each tenant's name; ordered by tenant name, model,
        then start."""
        start, end = check_window(start, end)
        bucket = bucket_start(self._db.dialect, granularity).label("bucket")
        where = [R.hour >= start, R.hour < end]
        if tenant_id is not None:
            where.append(R.tenant_id == tenant_id)
        stmt = (
            select(R.tenant_id, Tenant.name, R.model, bucket, *(_total(c) for c in SUMS))
            .join(Tenant, Tenant.id == R.tenant_id)
            .where(*where)
            .group_by(bucket, R.tenant_id, Tenant.name, R.model)
        )
        async with self._db.engine.connect() as conn:
            rows = (await conn.execute(stmt)).all()
        found = [
            ModelUsageBucket(
                tenant_id=tenant,
                tenant_name=name,
                model=model,
                start=as_utc(at),
                requests=requests,
                prompt_tokens=prompt,
                cached_tokens=cached,
                completion_tokens=completion,
            )
            for tenant, name, model, at, requests, prompt, cached, completion in rows
            if requests
        ]
        return sorted(found, key=lambda b: (b.tenant_name, b.tenant_id, b.model, b.start))
