"""Admin route for the console's live charts: the recent points of ``web.admin.live_metrics``."""

from __future__ import annotations

import inspect
from datetime import datetime
from typing import Any

from litestar import get
from litestar.di import NamedDependency
from litestar.params import FromQuery
from prometheus_client import CollectorRegistry

from engine.stats import EngineSnapshot
from web.admin.context import AdminServices, engine
from web.admin.live_metrics import (
    LATENCY_WINDOW_S,
    MIN_INTERVAL_S,
    LiveHistory,
    LiveMetrics,
    missing,
    read,
)
from web.admin.tenants_controller import AdminRequest
from web.ops.errors import ApiError


def _registry(metrics: object) -> CollectorRegistry | None:
    registry = getattr(metrics, "registry", None)
    return registry if isinstance(registry, CollectorRegistry) else None


async def _snapshot(request: AdminRequest) -> EngineSnapshot | None:
    """The engines' summed snapshot (the gateway role's is the fleet's last poll)."""
    stats = getattr(engine(request), "stats", None)
    if not callable(stats):
        return None
    snapshot: Any = stats()
    if inspect.isawaitable(snapshot):
        snapshot = await snapshot
    return snapshot if isinstance(snapshot, EngineSnapshot) else None


@get("/metrics/live", tags=["admin"])
async def live_metrics(
    request: AdminRequest,
    admin_services: NamedDependency[AdminServices],
    live_history: NamedDependency[LiveHistory],
    gateway_metrics: NamedDependency[Any],
    since: FromQuery[datetime | None] = None,
) -> LiveMetrics:
    """Tokens/s, TTFT and ITL p50/p99, running, waiting and KV pages per tenant, and refusals
    by reason, one point per poll (at most one a second); ``since`` keeps only later points."""
    if since is not None and since.tzinfo is None:
        raise ApiError(
            400, "since must carry a timezone (e.g. Z).", code="invalid_request", param="since"
        )
    history = live_history
    latest = history.add(read(_registry(gateway_metrics), await _snapshot(request)))
    tenants = await admin_services.tenants.list_tenants(include_deleted=True)
    return LiveMetrics(
        interval_s=MIN_INTERVAL_S,
        latency_window_s=LATENCY_WINDOW_S,
        missing=missing(latest),
        tenant_names={t.id: t.name for t in tenants},
        points=history.since(since),
    )
