"""The engine role's operations routes: health, metrics, the probes routers send, its state.

``/health`` is the only route open without the engine token (a router probes it before it
knows anything else); ``/server_info``, ``/model_info`` and ``/version`` (with SGLang's
``/get_`` spellings) answer the metadata probes smg sends when it admits a worker.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Any

from litestar import Response, get
from litestar.di import NamedDependency

from engine.stats import EngineSnapshot
from web.openai.generation import GenerationService
from web.ops.metrics import MEDIA_TYPE, GatewayMetrics

# Injected by name (web/ops/services.py, web/openai/generation_routes.py).
Generation = NamedDependency[GenerationService | None]
Engine = NamedDependency[Any]


def snapshot_of(engine: Any) -> EngineSnapshot:
    snapshot = engine.stats() if engine is not None else None
    return snapshot if isinstance(snapshot, EngineSnapshot) else EngineSnapshot()


@get("/health")
async def health(generation: Generation, engine: Engine) -> Response[dict[str, object]]:
    running = generation is not None and bool(getattr(engine, "is_running", False))
    ready = running and generation is not None and not generation.draining
    status = "ok" if ready else ("draining" if running else "unavailable")
    return Response({"status": status}, status_code=200 if ready else 503)


@get("/metrics")
async def metrics(
    generation: Generation, metrics: NamedDependency[GatewayMetrics]
) -> Response[bytes]:
    stats = generation.runtime.stats if generation is not None else None
    if stats is not None:
        metrics.update_engine(stats())
    return Response(metrics.render(), media_type=MEDIA_TYPE)


def _server_info(service: GenerationService | None, engine: Any) -> dict[str, object]:
    snap = snapshot_of(engine)
    name = service.runtime.name if service is not None else ""
    return {
        "model_path": name,
        "served_model_name": name,
        "context_length": service.runtime.max_model_len if service is not None else 0,
        "page_size": snap.page_size,
        "max_total_num_tokens": snap.num_pages_total * snap.page_size,
        "engine": "atrium",
    }


@get(["/server_info", "/get_server_info"])
async def server_info(generation: Generation, engine: Engine) -> dict[str, object]:
    return _server_info(generation, engine)


@get(["/model_info", "/get_model_info"])
async def model_info(generation: Generation, engine: Engine) -> dict[str, object]:
    info = _server_info(generation, engine)
    return {"model_path": info["model_path"], "is_generation": True}


@get("/version")
async def server_version() -> dict[str, str]:
    try:
        found = version("atrium")
    except PackageNotFoundError:
        found = "0"
    return {"version": found}


@get("/atrium/v1/state")
async def engine_state(engine: Engine) -> EngineSnapshot:
    """The engine's latest snapshot, for the gateways' engine view (an Atrium extension)."""
    return snapshot_of(engine)


OPEN_ROUTES = [health]
ROUTES = [metrics, server_info, model_info, server_version, engine_state]
