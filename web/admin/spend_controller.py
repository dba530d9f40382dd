"""Admin routes on what tenants spend and are refused: usage and cost by tenant, key and model;
one tenant's statement (quotas, what is used and left of each); this gateway's refusals by
tenant; every tenant's batches with their progress and usage."""

from __future__ import annotations

from datetime import datetime

import msgspec
from litestar import get
from litestar.di import NamedDependency
from litestar.params import FromPath, FromQuery

from tenants.batch_store import BatchInfo, BatchStore
from tenants.self_usage import SelfUsage, Statement
from tenants.spend import SpendRow
from web.admin.context import AdminServices, database
from web.admin.tenants_controller import AdminRequest
from web.admin.window import resolve_window
from web.ops.errors import ApiError, bad_request
from web.ops.refusals import Refusal, RefusalCount, RefusalLog

MAX_LIST = 500
BATCH_STATUSES = frozenset(
    {"validating", "in_progress", "finalizing", "completed", "failed", "expired", "cancelling",
     "cancelled"}
)  # fmt: skip


class Refusals(msgspec.Struct, kw_only=True):
    """Refusals this gateway answered since ``since`` (when it started): totals by tenant and
    reason, and the newest first with their message. ``counted`` is False on a server that
    admits no requests of its own (nothing to count)."""

    counted: bool
    since: datetime | None
    totals: list[RefusalCount]
    recent: list[Refusal]


def _limit(limit: int) -> int:
    if not 1 <= limit <= MAX_LIST:
        raise bad_request(f"limit must be between 1 and {MAX_LIST}", "limit")
    return limit


@get("/spend", tags=["admin"])
async def spend(
    request: AdminRequest,
    admin_services: NamedDependency[AdminServices],
    tenant_id: FromQuery[str | None] = None,
    start: FromQuery[datetime | None] = None,
    end: FromQuery[datetime | None] = None,
) -> list[SpendRow]:
    """Requests, failed requests, tokens and cost per tenant, key and model (and currency) of
    the requests started in ``[start, end)``, each priced as the billing export prices it."""
    start_at, end_at = resolve_window(start, end)
    return await admin_services.spend.breakdown(start_at, end_at, tenant_id or None)


@get("/tenants/{tenant_id:str}/statement", tags=["admin"])
async def tenant_statement(
    request: AdminRequest,
    tenant_id: FromPath[str],
    start: FromQuery[datetime | None] = None,
    end: FromQuery[datetime | None] = None,
) -> Statement:
    """The tenant's statement, as its own ``/v1/usage`` shows it: usage by day and model, its
    quotas, this month's budgets (used, reserved, left) and its rate limits now."""
    start_at, end_at = resolve_window(start, end)
    return await SelfUsage(database(request)).statement(tenant_id, start_at, end_at)


@get("/refusals", tags=["admin"])
async def refusals(
    request: AdminRequest,
    refusal_log: NamedDependency[RefusalLog | None],
    tenant_id: FromQuery[str | None] = None,
    limit: FromQuery[int] = 50,
) -> Refusals:
    log = refusal_log
    if log is None:
        return Refusals(counted=False, since=None, totals=[], recent=[])
    return Refusals(
        counted=True,
        since=log.since,
        totals=log.totals(tenant_id or None),
        recent=log.latest(tenant_id or None, _limit(limit)),
    )


@get("/batches", tags=["admin"])
async def batches(
    request: AdminRequest,
    batch_store: NamedDependency[BatchStore | None],
    tenant_id: FromQuery[str | None] = None,
    status: FromQuery[list[str] | None] = None,
    limit: FromQuery[int] = 100,
) -> list[BatchInfo]:
    """Batches of every tenant (or one), newest first, with their request counts and usage."""
    if batch_store is None:
        raise ApiError(503, "The database is not configured.", code="database_unavailable")
    statuses = status or []
    unknown = sorted(set(statuses) - BATCH_STATUSES)
    if unknown:
        raise bad_request(f"status must be among {', '.join(sorted(BATCH_STATUSES))}", "status")
    return await batch_store.recent(
        limit=_limit(limit), tenant_id=tenant_id or None, statuses=statuses
    )
