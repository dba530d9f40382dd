"""What a request costs against a monthly budget in money: the model's price when it was
admitted, the worst case to reserve (every prompt token uncached, every ``max_tokens`` used) and
what it used, both in micro-units, rounded up so the reservation always covers the charge."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from tenants.models import Price

TOKENS_PER_PRICE = 1_000_000  # prices are per million tokens


def _micros(numerator: int) -> int:
    return -(-numerator // TOKENS_PER_PRICE)


async def price_at(session: AsyncSession, model: str | None, at: datetime) -> Price | None:
    """The model's price in force at ``at`` (None: the model has no price; it costs nothing)."""
    if model is None:
        return None
    stmt = (
        select(Price)
        .where(Price.model == model, Price.effective_from <= at)
        .order_by(Price.effective_from.desc())
        .limit(1)
    )
    price: Price | None = await session.scalar(stmt)
    return price


def worst_cost(price: Price | None, prompt_tokens: int, max_tokens: int) -> int:
    if price is None:
        return 0
    return _micros(prompt_tokens * price.input_per_million + max_tokens * price.output_per_million)


def used_cost(price: Price | None, prompt_tokens: int, cached_tokens: int, completion: int) -> int:
    if price is None:
        return 0
    return _micros(
        (prompt_tokens - cached_tokens) * price.input_per_million
        + cached_tokens * price.cached_input_per_million
        + completion * price.output_per_million
    )
