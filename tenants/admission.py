"""Admission and settlement: status, prompt limit, rate buckets, concurrency, monthly budget.

Everything happens in one transaction that first locks the tenant's bucket row (then the key's);
the budget is reserved with one conditional UPDATE, so no interleaving of processes overspends it.
"""

from __future__ import annotations

import asyncio
import functools
from dataclasses import dataclass
from datetime import datetime
from typing import Any, NamedTuple

from sqlalchemy import BigInteger, bindparam, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from tenants.cost_budget import price_at, worst_cost
from tenants.database import Database, is_unavailable
from tenants.errors import (
    DuplicateRequestError,
    InvalidInputError,
    InvalidKeyError,
    PromptTooLargeError,
    TenantSuspendedError,
)
from tenants.models import KeyRateBucket, RateBucket, Reservation, TokenBudget
from tenants.rate_limit import Draw, RateState, drain, rate_state, refill_s, try_draw
from tenants.records import UsageEvent
from tenants.refusals import (
    budget_exhausted,
    check_reachable,
    rate_limited,
    tenant_rate_limited,
    too_many_running,
)
from tenants.schemas import Admission, AuthContext, Quotas, Usage
from tenants.settlement import BUDGET_ROW, Charge, checkpoint, release_all, take_reservations
from tenants.tenant_service import load_tenant, quotas_of
from tenants.timeutil import Clock, month_period, next_month_start, utc_now
from tenants.upsert import insert_ignore_stmt
from tenants.usage_store import insert_events

CONCURRENCY_RETRY_S = 1.0
MAX_GROUP = 256  # settlements written in one transaction at most


class _Settling(NamedTuple):
    """A settlement waiting for its group's transaction."""

    admission: Admission
    usage: Usage
    event: UsageEvent | None
    done: asyncio.Future[bool]


def _fail(done: asyncio.Future[Any], error: Exception) -> None:
    if not done.done():
        done.set_exception(error)


@dataclass(slots=True)
class KeyLimit:
    """A key's own requests/min bucket (locked), drawn only when the tenant's limits allow."""

    bucket: KeyRateBucket | None
    rpm: int | None

    def draw(self, now_s: float, amount: int = 1) -> Draw:
        if self.bucket is None:
            return try_draw(0.0, None, amount)
        elapsed = now_s - self.bucket.refilled_at
        return try_draw(drain(self.bucket.requests_drawn, self.rpm, elapsed), self.rpm, amount)

    def commit(self, draw: Draw, now_s: float) -> None:
        if self.bucket is not None:
            self.bucket.requests_drawn, self.bucket.refilled_at = draw.drawn, now_s

    def reported(self, rate: RateState, draw: Draw) -> RateState:
        """The rate state to report: the key's requests limit in place of the tenant's when
        the key's leaves fewer requests (or the tenant has none)."""
        remaining = rate.remaining_requests
        if self.bucket is None or (remaining is not None and remaining <= draw.remaining):
            return rate
        return rate._replace(
            limit_requests=self.rpm,
            remaining_requests=draw.remaining,
            reset_requests_s=refill_s(draw, self.rpm),
        )


# Built once (statements cost more CPU to build than to run); parameters by name.
_LOCK_BUCKET = (
    select(RateBucket).where(RateBucket.tenant_id == bindparam("of_tenant")).with_for_update()
)
_LOCK_KEY_BUCKET = (
    select(KeyRateBucket).where(KeyRateBucket.key_id == bindparam("of_key")).with_for_update()
)
_SPENT = select(TokenBudget.used + TokenBudget.reserved).where(*BUDGET_ROW)
_COST_SPENT = select(TokenBudget.cost_used + TokenBudget.cost_reserved).where(*BUDGET_ROW)


@functools.cache
def _reserve_stmt(token_budget: bool, cost_budget: bool) -> Any:
    """Add ``need`` tokens and ``cost`` micro-units to the month's reservations, only where
    they fit under ``budget`` and ``money`` (each checked when the tenant has it)."""
    need, cost = bindparam("need", type_=BigInteger), bindparam("cost", type_=BigInteger)
    stmt = (
        update(TokenBudget)
        .where(*BUDGET_ROW)
        .values(
            reserved=TokenBudget.reserved + need, cost_reserved=TokenBudget.cost_reserved + cost
        )
    )
    if token_budget:
        stmt = stmt.where(
            TokenBudget.used + TokenBudget.reserved + need <= bindparam("budget", type_=BigInteger)
        )
    if cost_budget:
        stmt = stmt.where(
            TokenBudget.cost_used + TokenBudget.cost_reserved + cost
            <= bindparam("money", type_=BigInteger)
        )
    return stmt


class AdmissionService:
    def __init__(self, db: Database, clock: Clock = utc_now) -> None:
        self._db = db
        self._clock = clock
        self._settling: list[_Settling] = []  # settlements waiting for the next transaction
        # Checkpoints of output delivered (request id: tokens) waiting for the next transaction,
        # and who waits for them to be written.
        self._delivered: dict[str, int] = {}
        self._checkpointed: list[asyncio.Future[None]] = []
        self._settler: asyncio.Task[None] | None = None  # writes them, one group at a time

    async def admit(
        self,
        ctx: AuthContext,
        request_id: str,
        prompt_tokens: int,
        max_tokens: int,
        *,
        model: str | None = None,
        lease_id: str | None = None,
    ) -> Admission:
        """Grant the request or raise (TenantSuspendedError, PromptTooLargeError,
        QuotaExceededError, DuplicateRequestError). Quotas are read fresh, not from ``ctx``.
        The reservation is the request's started record, owned by the gateway lease
        ``lease_id`` (see ``tenants.leases``)."""
        if prompt_tokens < 0 or max_tokens < 0 or not request_id:
            raise InvalidInputError("request_id, prompt_tokens and max_tokens are required")
        now = self._clock()
        period = month_period(now)
        need = prompt_tokens + max_tokens
        try:
            async with self._db.transaction() as session:
                tenant = await load_tenant(session, ctx.tenant_id)
                if tenant.status != "active":
                    raise TenantSuspendedError(f"tenant {tenant.id} is {tenant.status}")
                quotas = quotas_of(tenant)
                limit = quotas.max_prompt_tokens
                if limit is not None and prompt_tokens > limit:
                    raise PromptTooLargeError(
                        f"prompt of {prompt_tokens} tokens exceeds the limit of {limit}",
                        limit=limit,
                        prompt_tokens=prompt_tokens,
                    )
                if await session.get(Reservation, request_id) is not None:
                    raise DuplicateRequestError(f"request {request_id!r} is already admitted")
                cost = 0  # money is counted only while the tenant has a cost budget
                if quotas.monthly_cost_budget is not None:
                    price = await price_at(session, model, now)
                    cost = worst_cost(price, prompt_tokens, max_tokens)
                bucket = await self._lock_bucket(session, tenant.id, now.timestamp())
                key_bucket = None
                if ctx.key_requests_per_minute is not None:  # locked after the tenant's bucket
                    key_bucket = await self._lock_key_bucket(session, ctx.key_id, now.timestamp())
                admission = await self._take(
                    session,
                    bucket,
                    KeyLimit(key_bucket, ctx.key_requests_per_minute),
                    name=tenant.name,
                    quotas=quotas,
                    now=now,
                    prompt_tokens=prompt_tokens,
                    max_tokens=max_tokens,
                    cost=cost,
                    period=period,
                    request_id=request_id,
                    key_id=ctx.key_id,
                )
                session.add(
                    Reservation(
                        request_id=request_id,
                        tenant_id=tenant.id,
                        period=period,
                        tokens=need,
                        created_at=now,
                        lease_id=lease_id,
                        key_id=ctx.key_id,
                        model=model,
                        prompt_tokens=prompt_tokens,
                        cost=cost,
                    )
                )
                await session.flush()
        except IntegrityError as exc:
            raise DuplicateRequestError(f"request {request_id!r} was already admitted") from exc
        return admission

    async def settle(
        self, admission: Admission, usage: Usage, event: UsageEvent | None = None
    ) -> bool:
        """Release the slot and the reservation, charging ``usage`` to the month it was
        admitted in, and store ``event`` in the same transaction; True when this call took the
        reservation. Idempotent: only the first settlement of a request id (this, or a
        reclaimer's) does anything.

        Settlements that arrive while one is being written are written together, in one
        transaction of a few statements (group commit): requests that end at once (a burst's
        answers) cost the database, and the gateway's loop, little more than one."""
        loop = asyncio.get_running_loop()
        settling = _Settling(admission, usage, event, loop.create_future())
        self._settling.append(settling)
        self._wake_settler(loop)
        return await asyncio.shield(settling.done)

    async def checkpoint(self, delivered: dict[str, int]) -> None:
        """Record on the reservations of ``delivered`` (request id: output tokens delivered so
        far) how far each answer got, with the next group of settlements (or alone when none
        is waiting); a reclaimer bills that much should this gateway die. Returns once written;
        raises what failed the write."""
        if not delivered:
            return
        loop = asyncio.get_running_loop()
        for request_id, tokens in delivered.items():
            self._delivered[request_id] = max(tokens, self._delivered.get(request_id, 0))
        written: asyncio.Future[None] = loop.create_future()
        self._checkpointed.append(written)
        self._wake_settler(loop)
        await asyncio.shield(written)

    def _wake_settler(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._settler is None or self._settler.get_loop() is not loop:
            self._settler = loop.create_task(self._settle_queued())

    async def _settle_queued(self) -> None:
        group: list[_Settling] = []
        waiting: list[asyncio.Future[None]] = []
        try:
            while self._settling or self._checkpointed:
                group, self._settling = self._settling[:MAX_GROUP], self._settling[MAX_GROUP:]
                delivered, self._delivered = self._delivered, {}
                waiting, self._checkpointed = self._checkpointed, []
                results: list[bool | Exception]
                try:
                    results = list(await self._settle_group(group, delivered))
                except Exception as error:
                    for written in waiting:  # a checkpoint is retried by the next one
                        _fail(written, error)
                    if is_unavailable(error) or (len(group) == 1 and not delivered):
                        for settling in group:
                            _fail(settling.done, error)
                        continue
                    # One settlement's failure (its usage row refused) fails no other: each alone.
                    results = [await self._settle_alone(settling) for settling in group]
                else:
                    for written in waiting:
                        if not written.done():
                            written.set_result(None)
                for settling, result in zip(group, results, strict=True):
                    if isinstance(result, Exception):
                        _fail(settling.done, result)
                    elif not settling.done.done():
                        settling.done.set_result(result)
        except asyncio.CancelledError:  # the loop is closing: nobody is left to wait
            for settling in group + self._settling:
                settling.done.cancel()
            for written in waiting + self._checkpointed:
                written.cancel()
            self._settling, self._checkpointed, self._delivered = [], [], {}
            raise
        finally:
            if self._settler is asyncio.current_task():
                self._settler = None

    async def _settle_alone(self, settling: _Settling) -> bool | Exception:
        try:
            return (await self._settle_group([settling]))[0]
        except Exception as error:
            return error

    async def _settle_group(
        self, group: list[_Settling], delivered: dict[str, int] | None = None
    ) -> list[bool]:
        """Settle ``group`` and write the checkpoints ``delivered`` in one transaction; whether
        each settlement took its reservation (of two settlements of one request id, the
        first)."""
        async with self._db.transaction() as session:
            if delivered:  # a request settled in this group needs no checkpoint
                settled = {s.admission.request_id for s in group}
                await checkpoint(
                    session, {rid: n for rid, n in delivered.items() if rid not in settled}
                )
            if not group:
                return []
            held = await take_reservations(session, [s.admission.request_id for s in group])
            taken: list[bool] = []
            charges: list[Charge] = []
            events: list[UsageEvent] = []
            for settling in group:
                mine = held.pop(settling.admission.request_id, None)  # a second one finds none
                taken.append(mine is not None)
                if mine is None:
                    continue
                usage = settling.usage
                charges.append(
                    Charge(mine, usage.total_tokens, usage.cached_tokens, usage.completion_tokens)
                )
                if settling.event is not None:
                    events.append(settling.event)
            if events:
                await insert_events(self._db, session, events)
            await release_all(session, charges)
        return taken

    async def _lock_bucket(self, session: AsyncSession, tenant_id: str, now_s: float) -> RateBucket:
        row = {
            "tenant_id": tenant_id,
            "requests_drawn": 0.0,
            "tokens_drawn": 0.0,
            "refilled_at": now_s,
            "in_flight": 0,
        }
        bucket = await session.scalar(_LOCK_BUCKET, {"of_tenant": tenant_id})
        if bucket is None:  # the tenant's first request: create the row, then lock it
            await session.execute(insert_ignore_stmt(self._db.dialect, RateBucket), row)
            bucket = await session.scalar(_LOCK_BUCKET, {"of_tenant": tenant_id})
        if bucket is None:  # the tenant row is held, so the bucket cannot vanish
            raise RuntimeError("rate bucket missing after insert")
        return bucket

    async def _lock_key_bucket(
        self, session: AsyncSession, key_id: str, now_s: float
    ) -> KeyRateBucket:
        bucket = await session.scalar(_LOCK_KEY_BUCKET, {"of_key": key_id})
        if bucket is None:  # the key's first limited request
            row = {"key_id": key_id, "requests_drawn": 0.0, "refilled_at": now_s}
            await session.execute(insert_ignore_stmt(self._db.dialect, KeyRateBucket), row)
            bucket = await session.scalar(_LOCK_KEY_BUCKET, {"of_key": key_id})
        if bucket is None:
            raise InvalidKeyError("unknown API key")  # deleted under us: the key is gone
        return bucket

    async def _take(
        self,
        session: AsyncSession,
        bucket: RateBucket,
        key: KeyLimit,
        *,
        name: str,
        quotas: Quotas,
        now: datetime,
        prompt_tokens: int,
        max_tokens: int,
        cost: int,
        period: str,
        request_id: str,
        key_id: str,
    ) -> Admission:
        rpm, tpm = quotas.requests_per_minute, quotas.tokens_per_minute
        need = prompt_tokens + max_tokens
        now_s = now.timestamp()
        elapsed = now_s - bucket.refilled_at
        requests_now = drain(bucket.requests_drawn, rpm, elapsed)
        tokens_now = drain(bucket.tokens_drawn, tpm, elapsed)
        requests, tokens = try_draw(requests_now, rpm, 1), try_draw(tokens_now, tpm, need)
        key_requests = key.draw(now_s)
        # A refusal reports the limits as they are (it takes nothing); an admission, after it.
        rate = key.reported(
            rate_state(rpm, try_draw(requests_now, rpm, 0), tpm, try_draw(tokens_now, tpm, 0)),
            key.draw(now_s, 0),
        )
        check_reachable(
            quotas,
            name=name,
            prompt_tokens=prompt_tokens,
            max_tokens=max_tokens,
            cost=cost,
            rate=rate,
        )
        if requests.fits and tokens.fits and not key_requests.fits:
            raise rate_limited(
                reason="key_requests_per_minute",
                per_minute="requests",
                scope="key",
                name=key_id,
                limit=key.rpm or 0,
                remaining=key_requests.remaining,
                requested=1,
                retry_after_s=key_requests.retry_after_s,
                rate=rate,
            )
        if not (requests.fits and tokens.fits):
            raise tenant_rate_limited(
                name=name, rpm=rpm, requests=requests, tpm=tpm, tokens=tokens, need=need, rate=rate
            )
        cap = quotas.max_concurrent_requests
        if cap is not None and bucket.in_flight >= cap:
            raise too_many_running(
                reason="max_concurrent_requests",
                name=name,
                cap=cap,
                running=bucket.in_flight,
                retry_after_s=CONCURRENCY_RETRY_S,
                rate=rate,
            )
        budget_left = await self._reserve_budget(
            session, bucket.tenant_id, period, need, cost, quotas, name=name, rate=rate
        )
        bucket.requests_drawn, bucket.tokens_drawn = requests.drawn, tokens.drawn
        bucket.refilled_at = now_s
        bucket.in_flight += 1
        key.commit(key_requests, now_s)
        rate = key.reported(rate_state(rpm, requests, tpm, tokens), key_requests)
        return Admission(
            request_id=request_id,
            tenant_id=bucket.tenant_id,
            key_id=key_id,
            reserved_tokens=need,
            period=period,
            admitted_at=now,
            limit_requests=rate.limit_requests,
            remaining_requests=rate.remaining_requests,
            reset_requests_s=rate.reset_requests_s,
            limit_tokens=rate.limit_tokens,
            remaining_tokens=rate.remaining_tokens,
            reset_tokens_s=rate.reset_tokens_s,
            remaining_budget=budget_left,
        )

    async def _reserve_budget(
        self,
        session: AsyncSession,
        tenant_id: str,
        period: str,
        need: int,
        cost: int,
        quotas: Quotas,
        *,
        name: str,
        rate: RateState,
    ) -> int | None:
        """Reserve ``need`` tokens (and ``cost`` micro-units) of the month's budgets; returns
        what is left of the token budget after this reservation (None without one), or raises
        BudgetExhaustedError."""
        budget, money = quotas.monthly_token_budget, quotas.monthly_cost_budget
        stmt = _reserve_stmt(budget is not None, money is not None)
        params = {
            "of_tenant": tenant_id,
            "of_period": period,
            "need": need,
            "cost": cost,
            "budget": budget,
            "money": money,
        }
        spent_now = {"of_tenant": tenant_id, "of_period": period}
        reserved = (await session.execute(stmt, params)).rowcount == 1  # type: ignore[attr-defined]
        if not reserved:
            # No row for this month yet (or no room): make sure the row exists, try once more.
            row = {"tenant_id": tenant_id, "period": period, "used": 0, "reserved": 0}
            await session.execute(insert_ignore_stmt(self._db.dialect, TokenBudget), row)
            reserved = (await session.execute(stmt, params)).rowcount == 1  # type: ignore[attr-defined]
        if reserved:
            # What is left is what degraded admission may spend while the database is away.
            if budget is None:
                return None
            return budget - int(await session.scalar(_SPENT, spent_now) or 0)
        spent = int(await session.scalar(_SPENT, spent_now) or 0)
        now = self._clock()
        resets_at = next_month_start(now)
        if budget is None or spent + need <= budget:  # the money ran out, not the tokens
            cost_spent = int(await session.scalar(_COST_SPENT, spent_now) or 0)
            raise budget_exhausted(
                cost=True,
                name=name,
                budget=money or 0,
                spent=cost_spent,
                need=cost,
                resets_at=resets_at,
                now=now,
                rate=rate,
            )
        raise budget_exhausted(
            cost=False,
            name=name,
            budget=budget,
            spent=spent,
            need=need,
            resets_at=resets_at,
            now=now,
            rate=rate,
        )
