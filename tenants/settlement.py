"""Settling a reservation: take its row, free the slot and the unused tokens, charge the usage.

Shared by a gateway settling its own request and by the reclaimer settling a dead gateway's.
Rows are locked in one order everywhere: reservation, usage rows, rate bucket, then budget
(admission locks bucket then budget; the meter locks usage rows then budget).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, NamedTuple

from sqlalchemy import ColumnElement, Integer, bindparam, case, delete, update
from sqlalchemy.ext.asyncio import AsyncSession

from tenants.batch_store import batch_of_request
from tenants.cost_budget import price_at, used_cost
from tenants.models import RateBucket, Reservation, TokenBudget
from tenants.records import UsageEvent

UNKNOWN_MODEL = "unknown"  # reservations made before migration 0005 name no model


class Held(NamedTuple):
    """A reservation just taken (deleted): what was reserved, and the request's started record."""

    request_id: str
    tenant_id: str
    period: str
    tokens: int
    created_at: datetime
    key_id: str | None
    model: str | None
    prompt_tokens: int
    cost: int  # micro-units reserved against a cost budget (0: none)


# Built once (statements cost more CPU to build than to run); parameters by name.
_TAKE = (
    delete(Reservation)
    .where(Reservation.request_id == bindparam("request_id"))
    .returning(
        Reservation.request_id,
        Reservation.tenant_id,
        Reservation.period,
        Reservation.tokens,
        Reservation.created_at,
        Reservation.key_id,
        Reservation.model,
        Reservation.prompt_tokens,
        Reservation.cost,
    )
)
_FREE_SLOT = (
    update(RateBucket)
    .where(RateBucket.tenant_id == bindparam("of_tenant"))
    .values(
        in_flight=case((RateBucket.in_flight > 0, RateBucket.in_flight - 1), else_=0),
        tokens_drawn=case(
            (
                RateBucket.tokens_drawn > bindparam("refund", type_=Integer),
                RateBucket.tokens_drawn - bindparam("refund", type_=Integer),
            ),
            else_=0.0,
        ),
    )
)
# The month's budget row of a tenant (parameters ``of_tenant`` and ``of_period``).
BUDGET_ROW = (
    TokenBudget.tenant_id == bindparam("of_tenant"),
    TokenBudget.period == bindparam("of_period"),
)
_CHARGE = (
    update(TokenBudget)
    .where(*BUDGET_ROW)
    .values(
        reserved=TokenBudget.reserved - bindparam("held_tokens", type_=Integer),
        used=TokenBudget.used + bindparam("charged", type_=Integer),
        cost_reserved=TokenBudget.cost_reserved - bindparam("held_cost", type_=Integer),
        cost_used=TokenBudget.cost_used + bindparam("used_cost", type_=Integer),
    )
)


async def take_reservation(
    session: AsyncSession, request_id: str, *conditions: ColumnElement[bool]
) -> Held | None:
    """Delete the request's reservation (when ``conditions`` hold) and return it; None when
    there is none: somebody settled it first, which makes every settlement idempotent."""
    stmt = _TAKE.where(*conditions) if conditions else _TAKE
    row: Any = (await session.execute(stmt, {"request_id": request_id})).one_or_none()
    if row is None:
        return None
    return Held(*row)


async def release(
    session: AsyncSession, held: Held, charged: int, cached: int = 0, completion: int = 0
) -> None:
    """Free the slot, give the unused reserved tokens back to the minute bucket, and move the
    reservation to ``charged`` tokens used in the month it was admitted in (and, with a cost
    reservation, to what they cost: ``completion`` of them output, ``cached`` of the prompt
    from the cache; never more than was reserved)."""
    cost = 0
    if held.cost > 0:
        price = await price_at(session, held.model, held.created_at)
        cost = min(held.cost, used_cost(price, charged - completion, cached, completion))
        if price is not None and batch_of_request(held.request_id) is not None:
            cost = cost * (100 - price.batch_discount_percent) // 100  # as the export bills it
    refund = max(0, held.tokens - charged)  # unused max_tokens flow back
    await session.execute(_FREE_SLOT, {"of_tenant": held.tenant_id, "refund": refund})
    await session.execute(
        _CHARGE,
        {
            "of_tenant": held.tenant_id,
            "of_period": held.period,
            "held_tokens": held.tokens,
            "charged": charged,
            "held_cost": held.cost,
            "used_cost": cost,
        },
    )


def lost_event(held: Held, now: datetime) -> UsageEvent:
    """The usage event of a request whose gateway died: what the started record knows (the
    prompt), marked ``gateway_lost``."""
    return UsageEvent(
        request_id=held.request_id,
        tenant_id=held.tenant_id,
        key_id=held.key_id,
        model=held.model or UNKNOWN_MODEL,
        batch_id=batch_of_request(held.request_id),  # a batch line is billed at batch price
        prompt_tokens=held.prompt_tokens,
        cached_tokens=0,
        completion_tokens=0,
        status="gateway_lost",
        started_at=held.created_at,
        finished_at=max(now, held.created_at),
        duration_ms=max(0.0, (now - held.created_at).total_seconds() * 1000.0),
    )
