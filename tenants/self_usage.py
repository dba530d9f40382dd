"""One tenant's own statement: usage by day and model, quotas, this month's budget, rate state.

Read-only and scoped to the tenant the caller names (the gateway passes the key's tenant), so
nothing here can reveal another tenant's numbers.
"""

from __future__ import annotations

from datetime import datetime

import msgspec
from sqlalchemy import BigInteger, cast, func, select

from tenants.database import Database
from tenants.models import RateBucket, TokenBudget, UsageRollup
from tenants.rate_limit import drain
from tenants.schemas import Quotas
from tenants.tenant_service import load_tenant, quotas_of
from tenants.timeutil import Clock, check_window, month_period, next_month_start, utc_now
from tenants.usage_report import SQLITE_DAY_CHARS, as_utc, bucket_start

R = UsageRollup


class ModelDay(msgspec.Struct, frozen=True, kw_only=True):
    """One model's usage on one UTC day (``start`` is midnight)."""

    start: datetime
    model: str
    requests: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


class BudgetState(msgspec.Struct, frozen=True, kw_only=True):
    """The month's token budget and money budget (``cost_*``, micro-units of the prices'
    currency): ``remaining`` and ``cost_remaining`` are None where there is no such budget."""

    period: str
    resets_at: datetime
    limit: int | None
    used: int
    reserved: int
    remaining: int | None
    cost_limit: int | None
    cost_used: int
    cost_reserved: int
    cost_remaining: int | None


class RateState(msgspec.Struct, frozen=True, kw_only=True):
    """The per-minute buckets and the concurrency slots as they stand now."""

    limit_requests: int | None
    remaining_requests: int | None
    limit_tokens: int | None
    remaining_tokens: int | None
    max_concurrent_requests: int | None
    in_flight: int


class Statement(msgspec.Struct, frozen=True, kw_only=True):
    tenant_id: str
    tenant_name: str
    start: datetime
    end: datetime
    usage: list[ModelDay]
    quotas: Quotas
    budget: BudgetState
    rate_limits: RateState


def _left(limit: int | None, drawn: float) -> int | None:
    return None if limit is None else max(0, int(limit - drawn))


class SelfUsage:
    def __init__(self, db: Database, clock: Clock = utc_now) -> None:
        self._db = db
        self._clock = clock

    async def statement(self, tenant_id: str, start: datetime, end: datetime) -> Statement:
        """The tenant's statement for days starting in ``[start, end)`` and its state now."""
        start, end = check_window(start, end)
        now = self._clock()
        period = month_period(now)
        day = bucket_start(self._db.dialect, "day").label("day")
        sums = (R.requests, R.prompt_tokens, R.cached_tokens, R.completion_tokens)
        stmt = (
            select(day, R.model, *(cast(func.sum(column), BigInteger) for column in sums))
            .where(R.tenant_id == tenant_id, R.hour >= start, R.hour < end)
            .group_by(day, R.model)
            .order_by(day, R.model)
        )
        async with self._db.sessions() as session:
            tenant = await load_tenant(session, tenant_id)
            quotas = quotas_of(tenant)
            rows = (await session.execute(stmt)).all()
            budget = await session.get(TokenBudget, (tenant_id, period))
            bucket = await session.get(RateBucket, tenant_id)
        used, reserved = (0, 0) if budget is None else (budget.used, budget.reserved)
        cost_used, cost_reserved = (
            (0, 0) if budget is None else (budget.cost_used, budget.cost_reserved)
        )
        limit, money = quotas.monthly_token_budget, quotas.monthly_cost_budget
        rate = self._rate(quotas, bucket, now.timestamp())
        return Statement(
            tenant_id=tenant.id,
            tenant_name=tenant.name,
            start=start,
            end=end,
            usage=[
                ModelDay(
                    start=_day(at),
                    model=model,
                    requests=requests,
                    prompt_tokens=prompt,
                    cached_tokens=cached,
                    completion_tokens=completion,
                )
                for at, model, requests, prompt, cached, completion in rows
                if requests
            ],
            quotas=quotas,
            budget=BudgetState(
                period=period,
                resets_at=next_month_start(now),
                limit=limit,
                used=used,
                reserved=reserved,
                remaining=None if limit is None else max(0, limit - used - reserved),
                cost_limit=money,
                cost_used=cost_used,
                cost_reserved=cost_reserved,
                cost_remaining=None if money is None else max(0, money - cost_used - cost_reserved),
            ),
            rate_limits=rate,
        )

    @staticmethod
    def _rate(quotas: Quotas, bucket: RateBucket | None, now_s: float) -> RateState:
        rpm, tpm = quotas.requests_per_minute, quotas.tokens_per_minute
        if bucket is None:  # no request yet: every bucket is full
            requests_drawn = tokens_drawn = 0.0
            in_flight = 0
        else:
            elapsed = now_s - bucket.refilled_at
            requests_drawn = drain(bucket.requests_drawn, rpm, elapsed)
            tokens_drawn = drain(bucket.tokens_drawn, tpm, elapsed)
            in_flight = bucket.in_flight
        return RateState(
            limit_requests=rpm,
            remaining_requests=_left(rpm, requests_drawn),
            limit_tokens=tpm,
            remaining_tokens=_left(tpm, tokens_drawn),
            max_concurrent_requests=quotas.max_concurrent_requests,
            in_flight=in_flight,
        )


def _day(value: datetime | str) -> datetime:
    """A day bucket from either driver: PostgreSQL's timestamp, SQLite's ``YYYY-MM-DD`` text."""
    if isinstance(value, str):
        value = value[:SQLITE_DAY_CHARS]
    return as_utc(value)
