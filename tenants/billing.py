"""Billing export: one row per tenant, model and currency over ``[start, end)``.

Each request is priced by the price in force when it started: events are summed per price
segment in SQL, costs are added exactly and rounded once per row.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import ColumnElement, func, select

from tenants.billing_render import cost_numerator, format_money, manifest, render, round_micros
from tenants.database import Database
from tenants.errors import InvalidInputError
from tenants.models import Tenant, UsageEventRow
from tenants.price_service import PriceService
from tenants.records import BillingManifest, BillingRow, ExportFormat, PriceInfo
from tenants.timeutil import check_window

Ev = UsageEventRow


@dataclass(slots=True)
class _Acc:
    requests: int = 0
    prompt: int = 0
    cached: int = 0
    completion: int = 0
    numerator: int = 0


def _segments(prices: list[PriceInfo]) -> list[tuple[datetime, datetime | None, PriceInfo]]:
    """``(from, until, price)`` for one model's prices sorted by effective_from."""
    ends: list[datetime | None] = [p.effective_from for p in prices[1:]]
    return [(p.effective_from, end, p) for p, end in zip(prices, [*ends, None], strict=True)]


class BillingService:
    def __init__(self, db: Database, prices: PriceService) -> None:
        self._db = db
        self._prices = prices

    async def billing_export(
        self, start: datetime, end: datetime, fmt: ExportFormat = "csv"
    ) -> tuple[bytes, BillingManifest]:
        if fmt not in ("csv", "jsonl"):
            raise InvalidInputError("format must be csv or jsonl", "format")
        start, end = check_window(start, end)
        by_model: dict[str, list[PriceInfo]] = {}
        for price in await self._prices.list_prices():
            by_model.setdefault(price.model, []).append(price)
        accs: dict[tuple[str, str, str], _Acc] = {}
        in_window = (Ev.started_at >= start, Ev.started_at < end)
        # Models without any price, and each priced model before its first price: unpriced.
        unpriced = [Ev.model.not_in(list(by_model))] if by_model else []
        await self._sum_into(accs, None, *in_window, *unpriced)
        for model, prices in by_model.items():
            await self._sum_into(
                accs, None, *in_window, Ev.model == model, Ev.started_at < prices[0].effective_from
            )
            for lo, hi, price in _segments(prices):
                if (hi is not None and hi <= start) or lo >= end:
                    continue
                bounds = [Ev.started_at >= lo] + ([] if hi is None else [Ev.started_at < hi])
                await self._sum_into(accs, price, *in_window, Ev.model == model, *bounds)
        rows = await self._rows(accs)
        data = render(rows, fmt)
        unpriced_requests = sum(a.requests for (_, _, cur), a in accs.items() if not cur)
        return data, manifest(
            rows, data, start=start, end=end, fmt=fmt, unpriced_requests=unpriced_requests
        )

    async def _sum_into(
        self,
        accs: dict[tuple[str, str, str], _Acc],
        price: PriceInfo | None,
        *where: ColumnElement[bool],
    ) -> None:
        batch = Ev.batch_id.is_not(None)
        stmt = (
            select(
                Ev.tenant_id,
                Ev.model,
                batch,
                func.count(),
                func.sum(Ev.prompt_tokens),
                func.sum(Ev.cached_tokens),
                func.sum(Ev.completion_tokens),
            )
            .where(*where)
            .group_by(Ev.tenant_id, Ev.model, batch)
        )
        async with self._db.sessions() as session:
            rows = (await session.execute(stmt)).all()
        for tenant_id, model, is_batch, count, prompt, cached, completion in rows:
            acc = accs.setdefault((tenant_id, model, price.currency if price else ""), _Acc())
            acc.requests += int(count)
            acc.prompt += int(prompt)
            acc.cached += int(cached)
            acc.completion += int(completion)
            if price is not None:
                # Kept in hundredths, so a batch discount stays exact until the row's rounding.
                percent = 100 - (price.batch_discount_percent if is_batch else 0)
                numerator = cost_numerator(price, int(prompt), int(cached), int(completion))
                acc.numerator += numerator * percent

    async def _rows(self, accs: dict[tuple[str, str, str], _Acc]) -> list[BillingRow]:
        tenant_ids = sorted({tenant_id for tenant_id, _, _ in accs})
        async with self._db.sessions() as session:
            result = await session.execute(
                select(Tenant.id, Tenant.name).where(Tenant.id.in_(tenant_ids))
            )
            names = {tenant_id: name for tenant_id, name in result}
        rows = []
        for (tenant_id, model, currency), acc in sorted(accs.items()):
            micros = round_micros(acc.numerator, scale=100)
            rows.append(
                BillingRow(
                    tenant_id=tenant_id,
                    tenant_name=names.get(tenant_id, ""),
                    model=model,
                    requests=acc.requests,
                    prompt_tokens=acc.prompt,
                    cached_tokens=acc.cached,
                    completion_tokens=acc.completion,
                    cost=format_money(micros),
                    cost_micros=micros,
                    currency=currency,
                )
            )
        return rows
