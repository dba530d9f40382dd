"""Admission while the tenant database is unreachable: in-process limits from last-known quotas.

The monthly budget cannot be reserved without the database: a tenant with a budget spends at
most what was left of it at its last admission through the database (refused when this process
never saw one), and the usage event of such a request carries ``charge_budget``, so storing it
(when the spool replays) charges it once.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from tenants.errors import DuplicateRequestError, PromptTooLargeError, QuotaExceededError
from tenants.rate_limit import NO_LIMITS, RateState, RateView, drain, rate_state, try_draw
from tenants.refusals import (
    check_reachable,
    in_seconds,
    tenant_rate_limited,
    too_many_running,
    whose,
)
from tenants.schemas import AuthContext
from web.ops.metrics import child
from web.tenancy.db_monitor import DegradedMetrics

log = structlog.get_logger("atrium.web")
CONCURRENCY_RETRY_S = 1.0
BUDGET_RETRY_S = 30.0  # a guess at an outage's length: the database decides once it is back


@dataclass(frozen=True, slots=True)
class LocalTicket(RateView):
    """A request admitted in-process. ``ambiguous``: the database failed during its admission,
    which may have committed, so a stray reservation is released once it is back."""

    request_id: str
    tenant_id: str
    key_id: str
    reserved_tokens: int
    ambiguous: bool = False
    rate: RateState = NO_LIMITS  # the per-minute limits after this admission


@dataclass(slots=True)
class _Buckets:
    in_flight: int = 0
    requests_drawn: float = 0.0
    tokens_drawn: float = 0.0
    refilled_at: float = 0.0


class LocalAdmission:
    """Per-tenant concurrency and per-minute buckets of this process, for degraded admissions."""

    def __init__(
        self, metrics: DegradedMetrics, monotonic: Callable[[], float] = time.monotonic
    ) -> None:
        self._metrics = metrics
        self._monotonic = monotonic
        self._tenants: dict[str, _Buckets] = {}
        self._held: dict[str, LocalTicket] = {}
        self._budget_left: dict[str, int] = {}  # tenant -> budget left, as last known
        self._logged_outage = 0

    def note_budget(self, tenant_id: str, remaining: int | None) -> None:
        """The database just admitted a request of ``tenant_id`` leaving ``remaining`` tokens of
        its month's budget (None: no budget)."""
        if remaining is None:
            self._budget_left.pop(tenant_id, None)
        else:
            self._budget_left[tenant_id] = max(0, remaining)

    def admit(
        self,
        ctx: AuthContext,
        request_id: str,
        prompt_tokens: int,
        max_tokens: int,
        *,
        outage: int,
        ambiguous: bool = False,
    ) -> LocalTicket:
        """Grant or raise (PromptTooLargeError, QuotaExceededError, DuplicateRequestError)."""
        quotas = ctx.quotas
        limit = quotas.max_prompt_tokens
        if limit is not None and prompt_tokens > limit:
            raise PromptTooLargeError(
                f"prompt of {prompt_tokens} tokens exceeds the limit of {limit}",
                limit=limit,
                prompt_tokens=prompt_tokens,
            )
        if request_id in self._held:
            raise DuplicateRequestError(f"request {request_id!r} is already admitted")
        need = prompt_tokens + max_tokens
        buckets = self._tenants.setdefault(ctx.tenant_id, _Buckets(refilled_at=self._monotonic()))
        now = self._monotonic()
        rpm, tpm = quotas.requests_per_minute, quotas.tokens_per_minute
        elapsed = now - buckets.refilled_at
        requests_now = drain(buckets.requests_drawn, rpm, elapsed)
        tokens_now = drain(buckets.tokens_drawn, tpm, elapsed)
        requests, tokens = try_draw(requests_now, rpm, 1), try_draw(tokens_now, tpm, need)
        # A refusal reports the limits as they are (it takes nothing); an admission, after it.
        rate = rate_state(rpm, try_draw(requests_now, rpm, 0), tpm, try_draw(tokens_now, tpm, 0))
        name = ctx.tenant_name
        check_reachable(
            quotas, name=name, prompt_tokens=prompt_tokens, max_tokens=max_tokens, cost=0, rate=rate
        )
        budget = quotas.monthly_token_budget
        budget_left = self._budget_left.get(ctx.tenant_id)
        if budget is not None and (budget_left is None or need > budget_left):
            # Unsure or not enough: refuse rather than overspend a budget nobody can check.
            known = "nothing" if budget_left is None else f"{budget_left} tokens"
            raise QuotaExceededError(
                f"The monthly token budget of {whose('tenant', name)} ({budget} tokens) cannot "
                f"be checked while the tenant database is unreachable: {known} left at its "
                f"last check, and this request needs up to {need}. "
                f"Please try again in {in_seconds(BUDGET_RETRY_S)}.",
                reason="monthly_token_budget",
                retry_after_s=BUDGET_RETRY_S,
                rate=rate,
            )
        if not (requests.fits and tokens.fits):
            raise tenant_rate_limited(
                name=name, rpm=rpm, requests=requests, tpm=tpm, tokens=tokens, need=need, rate=rate
            )
        cap = quotas.max_concurrent_requests
        if cap is not None and buckets.in_flight >= cap:
            raise too_many_running(
                reason="max_concurrent_requests",
                name=name,
                cap=cap,
                running=buckets.in_flight,
                retry_after_s=CONCURRENCY_RETRY_S,
                rate=rate,
            )
        buckets.requests_drawn, buckets.tokens_drawn = requests.drawn, tokens.drawn
        buckets.refilled_at = now
        buckets.in_flight += 1
        if budget_left is not None and quotas.monthly_token_budget is not None:
            self._budget_left[ctx.tenant_id] = budget_left - need
        ticket = LocalTicket(
            request_id=request_id,
            tenant_id=ctx.tenant_id,
            key_id=ctx.key_id,
            reserved_tokens=need,
            ambiguous=ambiguous,
            rate=rate_state(rpm, requests, tpm, tokens),
        )
        self._held[request_id] = ticket
        m = self._metrics
        child(m.degraded_admissions, m.per_tenant, ctx.tenant_id).inc()
        if self._logged_outage != outage:
            self._logged_outage = outage
            log.warning("admission_degraded", outage=outage)
        return ticket

    def release(self, ticket: LocalTicket, used_tokens: int) -> bool:
        """Free the slot and refund unused tokens. Idempotent: only the first call counts."""
        if self._held.pop(ticket.request_id, None) is None:
            return False
        buckets = self._tenants[ticket.tenant_id]
        buckets.in_flight = max(0, buckets.in_flight - 1)
        refund = max(0, ticket.reserved_tokens - used_tokens)
        buckets.tokens_drawn = max(0.0, buckets.tokens_drawn - refund)
        if ticket.tenant_id in self._budget_left:
            self._budget_left[ticket.tenant_id] += refund
        return True

    def budget_left(self, tenant_id: str) -> int | None:
        return self._budget_left.get(tenant_id)

    def in_flight(self, tenant_id: str) -> int:
        buckets = self._tenants.get(tenant_id)
        return 0 if buckets is None else buckets.in_flight
