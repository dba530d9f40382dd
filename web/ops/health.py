"""Operations endpoints: `/healthz` (process up), `/readyz` (model and database), `/metrics`."""

from __future__ import annotations

import hmac
from typing import Any, Protocol, TypeGuard

from litestar import Request, Response, get
from litestar.di import NamedDependency
from litestar.params import SkipValidation

from web.ops.errors import ApiError
from web.ops.metrics import MEDIA_TYPE, GatewayMetrics
from web.settings import Settings


class TenancyHealth(Protocol):
    """What readiness reads of the app's tenancy (``web.tenancy.principal.Tenancy``)."""

    @property
    def usage_durable(self) -> bool: ...

    async def ready(self) -> bool: ...


@get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@get("/readyz")
async def readyz(
    generation: NamedDependency[Any],
    tenancy: NamedDependency[SkipValidation[TenancyHealth | None]],
    engine: NamedDependency[Any],
) -> Response[dict[str, object]]:
    model_loaded = generation is not None
    try:
        database = tenancy is not None and await tenancy.ready()
    except Exception:
        database = False
    draining = bool(model_loaded and generation.draining)
    # The engine runs in a child process that can die on its own (killed, out of memory).
    engine_running = bool(getattr(engine, "is_running", True))
    # Usage the meter can neither store nor spool would be served unbilled.
    usage_durable = tenancy is None or tenancy.usage_durable
    ready = model_loaded and database and engine_running and usage_durable and not draining
    body: dict[str, object] = {
        "status": "ready" if ready else "unavailable",
        "model_loaded": model_loaded,
        "engine_running": engine_running,
        "database": database,
        "usage_durable": usage_durable,
        "draining": draining,
    }
    return Response(body, status_code=200 if ready else 503)


def check_metrics_token(request: Request[Any, Any, Any], settings: Settings) -> None:
    """With ``metrics_token`` set, /metrics answers only ``Authorization: Bearer <token>``."""
    expected = settings.metrics_token
    if not expected:
        return
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    # Bytes, not str: compare_digest refuses non-ASCII strings, and any client can send them.
    given_bytes = given.strip().encode("utf-8", "backslashreplace")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given_bytes, expected.encode()):
        raise ApiError(
            401,
            "A valid metrics token is required: send `Authorization: Bearer <token>`.",
            code="invalid_metrics_token",
            headers={"WWW-Authenticate": "Bearer"},
        )


@get("/metrics")
async def metrics(
    request: Request[Any, Any, Any],
    settings: NamedDependency[Settings],
    metrics: NamedDependency[GatewayMetrics],
    generation: NamedDependency[Any],
) -> Response[bytes]:
    check_metrics_token(request, settings)
    registry = metrics
    runtimes = generation.runtimes if generation is not None else []
    snapshots = [runtime.stats() for runtime in runtimes if runtime.stats is not None]
    if snapshots:
        registry.update_engine(summed(snapshots))
    return Response(registry.render(), media_type=MEDIA_TYPE)


def summed(snapshots: list[dict[str, object]]) -> dict[str, object]:
    """The engines of several served models as one: numbers added, per-tenant numbers added
    tenant by tenant (what one engine lacks counts as nothing)."""
    if len(snapshots) == 1:
        return snapshots[0]
    total: dict[str, object] = {}
    for snapshot in snapshots:
        for name, value in snapshot.items():
            have = total.get(name)
            if isinstance(value, dict):
                merged: dict[str, object] = dict(have) if isinstance(have, dict) else {}
                for key, number in value.items():
                    before = merged.get(key, 0)
                    if _number(number) and _number(before):
                        merged[key] = before + number
                total[name] = merged
            elif _number(value):
                total[name] = have + value if _number(have) else value
            else:
                total.setdefault(name, value)
    return total


def _number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


ROUTES = [healthz, readyz, metrics]
