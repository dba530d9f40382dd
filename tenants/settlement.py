"""Settling reservations: take their rows, free the slots and the unused tokens, charge the usage.

Shared by a gateway settling its own requests (several in one transaction when they end
together) and by the reclaimer settling a dead gateway's. Rows are locked in one order
everywhere: reservations, usage rows, rate buckets, then budgets, each kind by key (admission
locks bucket then budget; the meter locks usage rows then budget).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any, NamedTuple

from sqlalchemy import BigInteger, ColumnElement, Table, bindparam, case, delete, update
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
    completion_tokens: int  # output delivered as of the serving gateway's last checkpoint


# Built once (statements cost more CPU to build than to run); parameters by name.
_HELD_COLUMNS = (
    Reservation.request_id,
    Reservation.tenant_id,
    Reservation.period,
    Reservation.tokens,
    Reservation.created_at,
    Reservation.key_id,
    Reservation.model,
    Reservation.prompt_tokens,
    Reservation.cost,
    Reservation.completion_tokens,
)
_TAKE = (
    delete(Reservation)
    .where(Reservation.request_id == bindparam("request_id"))
    .returning(*_HELD_COLUMNS)
)
_TAKE_MANY = (
    delete(Reservation)
    .where(Reservation.request_id.in_(bindparam("request_ids", expanding=True)))
    .returning(*_HELD_COLUMNS)
)
_reservations: Table = Reservation.__table__  # type: ignore[assignment]
# A checkpoint of the output delivered so far; never moves back (checkpoints may cross).
_CHECKPOINT = (
    update(_reservations)
    .where(
        _reservations.c.request_id == bindparam("of_request"),
        _reservations.c.completion_tokens < bindparam("delivered", type_=BigInteger),
    )
    .values(completion_tokens=bindparam("delivered", type_=BigInteger))
)
# Core tables, so that a list of parameter sets is one plain executemany. Freeing n slots and
# refunding r tokens at once ends where n single settlements would: each clamps at zero.
_buckets: Table = RateBucket.__table__  # type: ignore[assignment]
_budgets: Table = TokenBudget.__table__  # type: ignore[assignment]
_FREE_SLOTS = (
    update(_buckets)
    .where(_buckets.c.tenant_id == bindparam("of_tenant"))
    .values(
        in_flight=case(
            (
                _buckets.c.in_flight > bindparam("slots", type_=BigInteger),
                _buckets.c.in_flight - bindparam("slots", type_=BigInteger),
            ),
            else_=0,
        ),
        tokens_drawn=case(
            (
                _buckets.c.tokens_drawn > bindparam("refund", type_=BigInteger),
                _buckets.c.tokens_drawn - bindparam("refund", type_=BigInteger),
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
    update(_budgets)
    .where(
        _budgets.c.tenant_id == bindparam("of_tenant"), _budgets.c.period == bindparam("of_period")
    )
    .values(
        reserved=_budgets.c.reserved - bindparam("held_tokens", type_=BigInteger),
        used=_budgets.c.used + bindparam("charged", type_=BigInteger),
        cost_reserved=_budgets.c.cost_reserved - bindparam("held_cost", type_=BigInteger),
        cost_used=_budgets.c.cost_used + bindparam("used_cost", type_=BigInteger),
    )
)


class Charge(NamedTuple):
    """A taken reservation and what its request used: ``charged`` tokens in all, ``cached`` of
    the prompt from the cache, ``completion`` of them output."""

    held: Held
    charged: int
    cached: int = 0
    completion: int = 0


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


async def take_reservations(session: AsyncSession, request_ids: Sequence[str]) -> dict[str, Held]:
    """Delete the reservations of ``request_ids`` that are still there; returns them by id."""
    result: Any = await session.execute(_TAKE_MANY, {"request_ids": sorted(set(request_ids))})
    return {row[0]: Held(*row) for row in result}


async def checkpoint(session: AsyncSession, delivered: dict[str, int]) -> None:
    """Record on each reservation of ``delivered`` (request id: output tokens delivered so far)
    how far its answer got; a reservation already settled is no longer there, and is left be."""
    if delivered:
        await session.execute(
            _CHECKPOINT,
            [{"of_request": rid, "delivered": n} for rid, n in sorted(delivered.items())],
        )


async def release(
    session: AsyncSession, held: Held, charged: int, cached: int = 0, completion: int = 0
) -> None:
    """Free the slot, give the unused reserved tokens back to the minute bucket, and move the
    reservation to ``charged`` tokens used in the month it was admitted in (and, with a cost
    reservation, to what they cost: ``completion`` of them output, ``cached`` of the prompt
    from the cache; never more than was reserved)."""
    await release_all(session, [Charge(held, charged, cached, completion)])


async def release_all(session: AsyncSession, charges: Sequence[Charge]) -> None:
    """``release`` for each of ``charges``, with one statement per kind of row: each tenant's
    bucket and each month's budget row is updated once, by the sums."""
    buckets: dict[str, list[int]] = {}  # tenant: slots, refund
    budgets: dict[tuple[str, str], list[int]] = {}  # (tenant, period): held, charged, costs
    for held, charged, cached, completion in charges:
        cost = 0
        if held.cost > 0:
            price = await price_at(session, held.model, held.created_at)
            cost = min(held.cost, used_cost(price, charged - completion, cached, completion))
            if price is not None and batch_of_request(held.request_id) is not None:
                cost = cost * (100 - price.batch_discount_percent) // 100  # as the export bills
        bucket = buckets.setdefault(held.tenant_id, [0, 0])
        bucket[0] += 1
        bucket[1] += max(0, held.tokens - charged)  # unused max_tokens flow back
        budget = budgets.setdefault((held.tenant_id, held.period), [0, 0, 0, 0])
        budget[0] += held.tokens
        budget[1] += charged
        budget[2] += held.cost
        budget[3] += cost
    if not buckets:
        return
    await session.execute(
        _FREE_SLOTS,
        [
            {"of_tenant": tenant, "slots": slots, "refund": refund}
            for tenant, (slots, refund) in sorted(buckets.items())
        ],
    )
    await session.execute(
        _CHARGE,
        [
            {
                "of_tenant": tenant,
                "of_period": period,
                "held_tokens": sums[0],
                "charged": sums[1],
                "held_cost": sums[2],
                "used_cost": sums[3],
            }
            for (tenant, period), sums in sorted(budgets.items())
        ],
    )


def lost_event(held: Held, now: datetime) -> UsageEvent:
    """The usage event of a request whose gateway died: what the started record knows (the
    prompt, and the output delivered up to the gateway's last checkpoint), marked
    ``gateway_lost``."""
    return UsageEvent(
        request_id=held.request_id,
        tenant_id=held.tenant_id,
        key_id=held.key_id,
        model=held.model or UNKNOWN_MODEL,
        batch_id=batch_of_request(held.request_id),  # a batch line is billed at batch price
        prompt_tokens=held.prompt_tokens,
        cached_tokens=0,
        completion_tokens=held.completion_tokens,
        status="gateway_lost",
        started_at=held.created_at,
        finished_at=max(now, held.created_at),
        duration_ms=max(0.0, (now - held.created_at).total_seconds() * 1000.0),
    )
