"""The console's tenant pages: every tenant with this month's budgets, spend and refusals; one
tenant in detail; its keys; every tenant's batches."""

from __future__ import annotations

from collections import defaultdict
from datetime import UTC, datetime, timedelta
from typing import Any, NamedTuple

from litestar import Response, get
from litestar.params import FromPath, FromQuery
from litestar.response import Redirect

from tenants.self_usage import SelfUsage, Statement
from tenants.spend import SpendRow
from tenants.timeutil import month_period
from web.admin.context import batch_store_of, database, refusal_log_of, services
from web.admin.session import current_session
from web.admin.spend_controller import BATCH_STATUSES
from web.console.pages import ConsoleRequest, page
from web.console.render import ROOT

# (field, label, kind): what the tenant form edits, in its order.
QUOTA_FIELDS = (
    ("requests_per_minute", "Requests/min", "count"),
    ("tokens_per_minute", "Tokens/min", "count"),
    ("max_concurrent_requests", "Concurrency", "count"),
    ("monthly_token_budget", "Monthly token budget", "count"),
    ("monthly_cost_budget", "Monthly cost budget", "money"),
    ("max_prompt_tokens", "Max prompt tokens", "count"),
    ("kv_cache_share", "KV share (0–1)", "share"),
)
RECENT_BATCHES = 20
RECENT_REFUSALS = 20


class Limit(NamedTuple):
    """One limit of a tenant as the detail page draws it (``used`` None: not measured)."""

    name: str
    label: str
    used: int | None
    limit: int | None
    kind: str  # count | money
    unit: str


def month_start(now: datetime) -> datetime:
    return now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)


def spend_by_tenant(rows: list[SpendRow]) -> dict[str, list[tuple[str, int]]]:
    """Cost per tenant and currency (priced rows only), currencies in order."""
    sums: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for row in rows:
        if row.currency:
            sums[row.tenant_id][row.currency] += row.cost_micros
    return {tenant: sorted(by.items()) for tenant, by in sums.items()}


def limits(statement: Statement) -> list[Limit]:
    rate, budget, quotas = statement.rate_limits, statement.budget, statement.quotas

    def drawn(limit: int | None, remaining: int | None) -> int | None:
        return None if limit is None or remaining is None else limit - remaining

    return [
        Limit(
            "requests_per_minute",
            "Requests per minute",
            drawn(rate.limit_requests, rate.remaining_requests),
            rate.limit_requests,
            "count",
            "requests",
        ),
        Limit(
            "tokens_per_minute",
            "Tokens per minute",
            drawn(rate.limit_tokens, rate.remaining_tokens),
            rate.limit_tokens,
            "count",
            "tokens",
        ),
        Limit(
            "max_concurrent_requests",
            "Concurrent requests",
            rate.in_flight,
            rate.max_concurrent_requests,
            "count",
            "running now",
        ),
        Limit(
            "monthly_token_budget",
            "Monthly token budget",
            budget.used + budget.reserved,
            budget.limit,
            "count",
            "tokens",
        ),
        Limit(
            "monthly_cost_budget",
            "Monthly cost budget",
            budget.cost_used + budget.cost_reserved,
            budget.cost_limit,
            "money",
            "",
        ),
        Limit(
            "max_prompt_tokens", "Prompt tokens", None, quotas.max_prompt_tokens, "count", "tokens"
        ),
    ]


@get("/tenants")
async def tenants_page(request: ConsoleRequest) -> Response[Any]:
    if await current_session(request) is None:
        return Redirect(ROOT, status_code=303)
    svc = await services(request)
    tenants = await svc.tenants.list_tenants()
    now = datetime.now(UTC)
    period = month_period(now)
    budgets = await svc.spend.month_budgets(period, [t.id for t in tenants])
    spend = await svc.spend.breakdown(month_start(now), now + timedelta(minutes=1))
    log = refusal_log_of(request.app.state)
    refused: dict[str, int] = defaultdict(int)
    for count in log.totals() if log is not None else []:
        refused[count.tenant_id] += count.count
    return await page(
        request,
        "tenants.html",
        "tenants",
        "Tenants",
        tenants=tenants,
        quota_fields=QUOTA_FIELDS,
        period=period,
        budgets=budgets,
        spend=spend_by_tenant(spend),
        refusals=refused,
        refusals_since=None if log is None else log.since,
    )


@get("/tenants/{tenant_id:str}")
async def tenant_page(request: ConsoleRequest, tenant_id: FromPath[str]) -> Response[Any]:
    if await current_session(request) is None:
        return Redirect(ROOT, status_code=303)
    svc = await services(request)
    tenant = await svc.tenants.get(tenant_id)
    now = datetime.now(UTC)
    statement = await SelfUsage(database(request)).statement(
        tenant_id, month_start(now), now + timedelta(minutes=1)
    )
    rows = await svc.spend.breakdown(month_start(now), now + timedelta(minutes=1), tenant_id)
    by_model: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0, 0, 0, 0, 0])
    for row in rows:
        sums = by_model[(row.model, row.currency)]
        values = (row.requests, row.failed, row.prompt_tokens, row.cached_tokens)
        for i, value in enumerate((*values, row.completion_tokens, row.cost_micros)):
            sums[i] += value
    log = refusal_log_of(request.app.state)
    store = batch_store_of(request.app.state)
    return await page(
        request,
        "tenant.html",
        "tenants",
        tenant.name,
        tenant=tenant,
        quota_fields=QUOTA_FIELDS,
        period=statement.budget.period,
        resets_at=statement.budget.resets_at,
        limits=limits(statement),
        kv_share=statement.quotas.kv_cache_share,
        spend=spend_by_tenant(rows).get(tenant_id, []),
        by_model=sorted(by_model.items()),
        by_key=rows,
        keys=await svc.keys.list_keys(tenant_id),
        refusal_totals=[] if log is None else log.totals(tenant_id),
        refusals=[] if log is None else log.latest(tenant_id, RECENT_REFUSALS),
        refusals_counted=log is not None,
        refusals_since=None if log is None else log.since,
        batches=[]
        if store is None
        else await store.recent(limit=RECENT_BATCHES, tenant_id=tenant_id),
        now=now,
    )


@get("/keys")
async def keys_page(
    request: ConsoleRequest, tenant_id: FromQuery[str | None] = None
) -> Response[Any]:
    if await current_session(request) is None:
        return Redirect(ROOT, status_code=303)
    svc = await services(request)
    tenants = await svc.tenants.list_tenants()
    selected = next((t for t in tenants if t.id == tenant_id), tenants[0] if tenants else None)
    keys = await svc.keys.list_keys(selected.id) if selected is not None else []
    models = sorted(
        {price.model for price in await svc.prices.list_prices()}
        | set(selected.quotas.models or () if selected else ())
    )
    return await page(
        request,
        "keys.html",
        "keys",
        "Keys",
        tenants=tenants,
        selected=selected,
        keys=keys,
        known_models=models,
        now=datetime.now(UTC),
    )


@get("/batches")
async def batches_page(
    request: ConsoleRequest,
    tenant_id: FromQuery[str | None] = None,
    status: FromQuery[str | None] = None,
) -> Response[Any]:
    if await current_session(request) is None:
        return Redirect(ROOT, status_code=303)
    svc = await services(request)
    tenants = await svc.tenants.list_tenants(include_deleted=True)
    store = batch_store_of(request.app.state)
    statuses = [status] if status else []
    found = (
        []
        if store is None
        else await store.recent(limit=200, tenant_id=tenant_id or None, statuses=statuses)
    )
    return await page(
        request,
        "batches.html",
        "batches",
        "Batches",
        tenants=tenants,
        names={t.id: t.name for t in tenants},
        batches=found,
        tenant_id=tenant_id or "",
        status=status or "",
        statuses=sorted(BATCH_STATUSES),
        database=store is not None,
    )
