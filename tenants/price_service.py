"""Model prices per million tokens (integer micro-units), each in force from ``effective_from``."""

from __future__ import annotations

from sqlalchemy import select

from tenants.audit import add_entry
from tenants.database import Database
from tenants.models import Price
from tenants.records import PriceInfo, PriceSet, check_model
from tenants.timeutil import Clock, aware, utc_now


def price_info(row: Price) -> PriceInfo:
    return PriceInfo(
        model=row.model,
        input_per_million=row.input_per_million,
        cached_input_per_million=row.cached_input_per_million,
        output_per_million=row.output_per_million,
        currency=row.currency,
        effective_from=row.effective_from,
        batch_discount_percent=row.batch_discount_percent,
    )


class PriceService:
    def __init__(self, db: Database, clock: Clock = utc_now) -> None:
        self._db = db
        self._clock = clock

    async def set_price(self, model: str, spec: PriceSet, *, actor: str = "admin") -> PriceInfo:
        """Add a price from ``spec.effective_from`` (default now); the same instant replaces."""
        check_model(model)
        now = self._clock()
        start = now if spec.effective_from is None else aware(spec.effective_from, "effective_from")
        async with self._db.transaction() as session:
            row = await session.scalar(
                select(Price)
                .where(Price.model == model, Price.effective_from == start)
                .with_for_update()
            )
            before = None if row is None else price_info(row)
            if row is None:
                row = Price(model=model, effective_from=start)
                session.add(row)
            row.input_per_million = spec.input_per_million
            row.cached_input_per_million = spec.cached_input_per_million
            row.output_per_million = spec.output_per_million
            row.currency = spec.currency
            row.batch_discount_percent = spec.batch_discount_percent
            await session.flush()
            after = price_info(row)
            add_entry(
                session,
                at=now,
                actor=actor,
                action="price.set",
                target=model,
                before=before,
                after=after,
            )
        return after

    async def list_prices(self, model: str | None = None) -> list[PriceInfo]:
        """Every price (history included), by model then effective_from."""
        stmt = select(Price).order_by(Price.model, Price.effective_from)
        if model is not None:
            stmt = stmt.where(Price.model == model)
        async with self._db.sessions() as session:
            return [price_info(row) for row in await session.scalars(stmt)]
