"""Spend for operators: usage and its cost per tenant, key and model over a window, and each
tenant's month of budgets.

Each request is priced by the price in force when it started, as the billing export prices it
(batch lines at their discount), and rounded once per row; unpriced requests cost nothing and
carry no currency.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

import msgspec
from sqlalchemy import ColumnElement, Integer, case, func, select

from tenants.billing_render import cost_numerator, round_micros
from tenants.database import Database
from tenants.models import ApiKey, TokenBudget, UsageEventRow
from tenants.price_service import PriceService
from tenants.records import PriceInfo
from tenants.timeutil import check_window

Ev = UsageEventRow
# Requests that ended without a full answer through no doing of the client's.
FAILED_STATUSES = ("error", "timeout", "unavailable", "rejected", "gateway_lost")


class SpendRow(msgspec.Struct, frozen=True, kw_only=True):
    """One tenant, key and model (and currency) over a window; ``key_id`` is None for requests
    no key made (a reclaimed request of an old gateway)."""

    tenant_id: str
    key_id: str | None
    key_name: str | None  # None: no key, or a key no longer stored
    model: str
    requests: int
    failed: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    cost_micros: int
    currency: str  # "" where the model had no price


class MonthBudget(msgspec.Struct, frozen=True, kw_only=True):
    """What a tenant used and holds reserved of its month's budgets (money in micro-units;
    counted while the tenant has a cost budget)."""

    tenant_id: str
    period: str
    used: int
    reserved: int
    cost_used: int
    cost_reserved: int


@dataclass(slots=True)
class _Acc:
    requests: int = 0
    failed: int = 0
    prompt: int = 0
    cached: int = 0
    completion: int = 0
    numerator: int = 0  # cost × 10⁶ × 100 (hundredths keep a batch discount exact)


Group = tuple[str, str | None, str, str]  # tenant, key, model, currency


class SpendReport:
    def __init__(self, db: Database, prices: PriceService) -> None:
        self._db = db
        self._prices = prices

    async def breakdown(
        self, start: datetime, end: datetime, tenant_id: str | None = None
    ) -> list[SpendRow]:
        """Rows for requests started in ``[start, end)``, by tenant, key, model and currency."""
        start, end = check_window(start, end)
        by_model: dict[str, list[PriceInfo]] = {}
        for price in await self._prices.list_prices():
            by_model.setdefault(price.model, []).append(price)
        where = [Ev.started_at >= start, Ev.started_at < end]
        if tenant_id is not None:
            where.append(Ev.tenant_id == tenant_id)
        accs: dict[Group, _Acc] = {}
        unpriced = [Ev.model.not_in(list(by_model))] if by_model else []
        await self._sum_into(accs, None, *where, *unpriced)
        for model, prices in by_model.items():
            first = prices[0].effective_from
            await self._sum_into(accs, None, *where, Ev.model == model, Ev.started_at < first)
            ends: list[datetime | None] = [p.effective_from for p in prices[1:]]
            for price, until in zip(prices, [*ends, None], strict=True):
                if (until is not None and until <= start) or price.effective_from >= end:
                    continue
                bounds = [Ev.started_at >= price.effective_from]
                if until is not None:
                    bounds.append(Ev.started_at < until)
                await self._sum_into(accs, price, *where, Ev.model == model, *bounds)
        names = await self._key_names({key for _, key, _, _ in accs if key is not None})
        return [
            SpendRow(
                tenant_id=tenant,
                key_id=key,
                key_name=None if key is None else names.get(key),
                model=model,
                requests=acc.requests,
                failed=acc.failed,
                prompt_tokens=acc.prompt,
                cached_tokens=acc.cached,
                completion_tokens=acc.completion,
                cost_micros=round_micros(acc.numerator, scale=100),
                currency=currency,
            )
            for (tenant, key, model, currency), acc in sorted(
                accs.items(), key=lambda item: (item[0][0], item[0][1] or "", *item[0][2:])
            )
        ]

    async def _key_names(self, key_ids: set[str]) -> dict[str, str]:
        if not key_ids:
            return {}
        stmt = select(ApiKey.id, ApiKey.name).where(ApiKey.id.in_(sorted(key_ids)))
        async with self._db.sessions() as session:
            return {key_id: name for key_id, name in await session.execute(stmt)}

    async def _sum_into(
        self, accs: dict[Group, _Acc], price: PriceInfo | None, *where: ColumnElement[bool]
    ) -> None:
        batch = Ev.batch_id.is_not(None)
        failed = func.sum(case((Ev.status.in_(FAILED_STATUSES), 1), else_=0).cast(Integer))
        stmt = (
            select(
                Ev.tenant_id,
                Ev.key_id,
                Ev.model,
                batch,
                func.count(),
                failed,
                func.sum(Ev.prompt_tokens),
                func.sum(Ev.cached_tokens),
                func.sum(Ev.completion_tokens),
            )
            .where(*where)
            .group_by(Ev.tenant_id, Ev.key_id, Ev.model, batch)
        )
        async with self._db.sessions() as session:
            rows = (await session.execute(stmt)).all()
        for tenant, key, model, is_batch, count, bad, prompt, cached, completion in rows:
            acc = accs.setdefault((tenant, key, model, price.currency if price else ""), _Acc())
            acc.requests += int(count)
            acc.failed += int(bad or 0)
            acc.prompt += int(prompt)
            acc.cached += int(cached)
            acc.completion += int(completion)
            if price is not None:
                percent = 100 - (price.batch_discount_percent if is_batch else 0)
                acc.numerator += cost_numerator(
                    price, int(prompt), int(cached), int(completion)
                ) * (percent)

    async def month_budgets(
        self, period: str, tenant_ids: Sequence[str] | None = None
    ) -> dict[str, MonthBudget]:
        """Each tenant's budget row of ``period`` (``YYYY-MM``); a tenant without one used
        nothing yet and is absent."""
        stmt = select(TokenBudget).where(TokenBudget.period == period)
        if tenant_ids is not None:
            stmt = stmt.where(TokenBudget.tenant_id.in_(list(tenant_ids)))
        async with self._db.sessions() as session:
            rows = list(await session.scalars(stmt))
        return {
            row.tenant_id: MonthBudget(
                tenant_id=row.tenant_id,
                period=row.period,
                used=row.used,
                reserved=row.reserved,
                cost_used=row.cost_used,
                cost_reserved=row.cost_reserved,
            )
            for row in rows
        }
