"""`GET /v1/usage`: a tenant key's own usage by day and model, quotas, budget and rate state.

The ``data`` buckets follow OpenAI's usage API (``start_time``/``end_time`` in Unix seconds,
one bucket per UTC day, results per model); the rest is Atrium's. The key's tenant is the only
one it can see: nothing in the query names a tenant.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import msgspec
from litestar import Request, get
from sqlalchemy import exc as sa_exc

from tenants.database import is_unavailable
from tenants.schemas import Quotas
from tenants.self_usage import BudgetState, RateState, SelfUsage, Statement
from tenants.timeutil import day_floor
from web.ops.errors import ApiError, bad_request, unavailable
from web.tenancy.auth import authenticate

USAGE_READ = "usage:read"  # the key scope this endpoint needs
QUERY = ("start_time", "end_time", "bucket_width")
MAX_UNIX_S = 253402300799  # 9999-12-31T23:59:59Z
DAY = timedelta(days=1)


class UsageResult(msgspec.Struct, kw_only=True):
    model: str
    num_model_requests: int
    input_tokens: int
    input_cached_tokens: int
    output_tokens: int
    object: str = "tenant.usage.completions.result"


class UsageBucketOut(msgspec.Struct, kw_only=True):
    start_time: int
    end_time: int
    results: list[UsageResult]
    object: str = "bucket"


class UsageResponse(msgspec.Struct, kw_only=True):
    tenant_id: str
    tenant_name: str
    start_time: int
    end_time: int
    data: list[UsageBucketOut]
    quotas: Quotas
    budget: BudgetState
    rate_limits: RateState
    object: str = "tenant.usage"
    has_more: bool = False
    next_page: str | None = None


def _unix(request: Request[Any, Any, Any], name: str) -> datetime | None:
    raw = request.query_params.get(name)
    if raw is None:
        return None
    if not raw.isdigit() or int(raw) > MAX_UNIX_S:
        raise bad_request(f"{name} must be Unix seconds (a whole number)", param=name)
    return datetime.fromtimestamp(int(raw), UTC)


def _window(request: Request[Any, Any, Any], now: datetime) -> tuple[datetime, datetime]:
    """Whole UTC days; by default from the first of this month to the end of today."""
    for name in request.query_params:
        if name not in QUERY:
            raise bad_request(
                f"Unknown query parameter `{name}`; this endpoint takes {', '.join(QUERY)}.",
                param=name,
                code="unsupported_parameter",
            )
    width = request.query_params.get("bucket_width", "1d")
    if width != "1d":
        raise bad_request("bucket_width must be 1d (one bucket per UTC day)", "bucket_width")
    start = _unix(request, "start_time") or day_floor(now).replace(day=1)
    end = _unix(request, "end_time") or day_floor(now) + DAY
    if end <= start:
        raise bad_request("end_time must be after start_time", param="end_time")
    if end - start > timedelta(days=366):
        raise bad_request("the window is at most 366 days", param="end_time")
    return day_floor(start), end


def _buckets(statement: Statement) -> list[UsageBucketOut]:
    by_day: dict[datetime, list[UsageResult]] = {}
    for row in statement.usage:
        by_day.setdefault(row.start, []).append(
            UsageResult(
                model=row.model,
                num_model_requests=row.requests,
                input_tokens=row.prompt_tokens,
                input_cached_tokens=row.cached_tokens,
                output_tokens=row.completion_tokens,
            )
        )
    return [
        UsageBucketOut(
            start_time=int(day.timestamp()), end_time=int((day + DAY).timestamp()), results=rows
        )
        for day, rows in by_day.items()
    ]


@get("/v1/usage")
async def own_usage(request: Request[Any, Any, Any]) -> UsageResponse:
    principal = await authenticate(request, USAGE_READ)
    domain = getattr(request.app.state, "tenant_domain", None)
    if domain is None:
        raise ApiError(404, "Usage is kept only with a tenant database.", code="not_found")
    start, end = _window(request, datetime.now(UTC))
    try:
        statement = await SelfUsage(domain.db).statement(principal.tenant_id, start, end)
    except (sa_exc.OperationalError, sa_exc.InterfaceError, OSError) as exc:
        if isinstance(exc, OSError) or is_unavailable(exc):
            raise unavailable("The usage store is unreachable; try again.", 5.0) from exc
        raise
    return UsageResponse(
        tenant_id=statement.tenant_id,
        tenant_name=statement.tenant_name,
        start_time=int(start.timestamp()),
        end_time=int(end.timestamp()),
        data=_buckets(statement),
        quotas=statement.quotas,
        budget=statement.budget,
        rate_limits=statement.rate_limits,
    )


ROUTES = [own_usage]
