"""Admin route for the console's live charts: the recent points of ``web.admin.live_metrics``."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from litestar import get
from litestar.di import NamedDependency
from litestar.params import FromQuery

from web.admin.context import AdminServices, engine
from web.admin.engine_state import engine_tenant_name
from web.admin.live_metrics import (
    HISTORY_S,
    LATENCY_WINDOW_S,
    LiveHistory,
    LiveMetrics,
    missing,
    read,
)
from web.admin.live_sampler import SAMPLE_INTERVAL_S, engine_snapshot, registry_of
from web.admin.tenants_controller import AdminRequest
from web.ops.errors import ApiError


@get("/metrics/live", tags=["admin"])
async def live_metrics(
    request: AdminRequest,
    admin_services: NamedDependency[AdminServices],
    live_history: NamedDependency[LiveHistory],
    gateway_metrics: NamedDependency[Any],
    since: FromQuery[datetime | None] = None,
) -> LiveMetrics:
    """Requests, errors and tokens per second, TTFT and ITL p50/p99, running, waiting and KV
    pages per tenant, and refusals by reason: one point per sample (every few seconds from
    start-up, the last hour kept); ``since`` keeps only later points."""
    if since is not None and since.tzinfo is None:
        raise ApiError(
            400, "since must carry a timezone (e.g. Z).", code="invalid_request", param="since"
        )
    history = live_history
    latest = history.latest
    if not history.sampled or latest is None:  # no sampler on this app: each poll samples
        reading = read(registry_of(gateway_metrics), await engine_snapshot(engine(request)))
        latest = history.add(reading)
    tenants = await admin_services.tenants.list_tenants(include_deleted=True)
    names = {t.id: t.name for t in tenants}
    points = history.since(since)
    seen = {t.tenant_id for p in points for t in p.tenants}
    return LiveMetrics(
        interval_s=SAMPLE_INTERVAL_S,
        latency_window_s=LATENCY_WINDOW_S,
        history_s=HISTORY_S,
        missing=missing(latest),
        tenant_names={t: engine_tenant_name(t, names) or t for t in sorted(seen | set(names))},
        points=points,
    )
