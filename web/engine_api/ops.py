"""The engine role's operations routes: health, metrics, the probes routers send, its state.

``/health`` is the only route open without the engine token (a router probes it before it
knows anything else); ``/server_info``, ``/model_info`` and ``/version`` (with SGLang's
``/get_`` spellings) answer the metadata probes smg sends when it admits a worker.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Any

from litestar import Request, Response, get

from engine.stats import EngineSnapshot
from web.openai.generation import GenerationService
from web.ops.metrics import CONTENT_TYPE, GatewayMetrics


def _service(request: Request[Any, Any, Any]) -> GenerationService | None:
    service: GenerationService | None = request.app.state.get("generation")
    return service


def snapshot_of(request: Request[Any, Any, Any]) -> EngineSnapshot:
    engine = request.app.state.get("engine")
    snapshot = engine.stats() if engine is not None else None
    return snapshot if isinstance(snapshot, EngineSnapshot) else EngineSnapshot()


@get("/health")
async def health(request: Request[Any, Any, Any]) -> Response[dict[str, object]]:
    service = _service(request)
    engine = request.app.state.get("engine")
    running = service is not None and bool(getattr(engine, "is_running", False))
    ready = running and service is not None and not service.draining
    status = "ok" if ready else ("draining" if running else "unavailable")
    return Response({"status": status}, status_code=200 if ready else 503)


@get("/metrics")
async def metrics(request: Request[Any, Any, Any]) -> Response[bytes]:
    registry: GatewayMetrics = request.app.state.metrics
    service = _service(request)
    stats = service.runtime.stats if service is not None else None
    if stats is not None:
        registry.update_engine(stats())
    return Response(registry.render(), media_type=CONTENT_TYPE)


def _server_info(request: Request[Any, Any, Any]) -> dict[str, object]:
    service = _service(request)
    snap = snapshot_of(request)
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
async def server_info(request: Request[Any, Any, Any]) -> dict[str, object]:
    return _server_info(request)


@get(["/model_info", "/get_model_info"])
async def model_info(request: Request[Any, Any, Any]) -> dict[str, object]:
    info = _server_info(request)
    return {"model_path": info["model_path"], "is_generation": True}


@get("/version")
async def server_version() -> dict[str, str]:
    try:
        found = version("atrium")
    except PackageNotFoundError:
        found = "0"
    return {"version": found}


@get("/atrium/v1/state")
async def engine_state(request: Request[Any, Any, Any]) -> EngineSnapshot:
    """The engine's latest snapshot, for the gateways' engine view (an Atrium extension)."""
    return snapshot_of(request)


OPEN_ROUTES = [health]
ROUTES = [metrics, server_info, model_info, server_version, engine_state]
