"""Samples the live charts' numbers every few seconds from start-up, so the console shows the
last hour whenever it is opened (not only since it was)."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import Awaitable, Callable
from typing import Any

import structlog
from litestar.datastructures import State
from prometheus_client import CollectorRegistry

from engine.stats import EngineSnapshot
from web.admin.context import live_history_of
from web.admin.live_metrics import LiveHistory, Reading, read

SAMPLE_INTERVAL_S = 2.0
log = structlog.get_logger("atrium.admin")


def registry_of(metrics: object) -> CollectorRegistry | None:
    registry = getattr(metrics, "registry", None)
    return registry if isinstance(registry, CollectorRegistry) else None


async def engine_snapshot(engine: object) -> EngineSnapshot | None:
    """The engines' summed snapshot (the gateway role's is the fleet's last poll)."""
    stats = getattr(engine, "stats", None)
    if not callable(stats):
        return None
    snapshot: Any = stats()
    if inspect.isawaitable(snapshot):
        snapshot = await snapshot
    return snapshot if isinstance(snapshot, EngineSnapshot) else None


async def sample(state: State) -> Reading:
    """Read the app's metrics and engines now and add the reading to its history."""
    reading = read(registry_of(state.get("metrics")), await engine_snapshot(state.get("engine")))
    return live_history_of(state).add(reading)


async def _run(state: State, history: LiveHistory, interval_s: float) -> None:
    while True:
        try:
            await sample(state)
        except Exception:  # an engine between restarts: the next sample tries again
            log.warning("live_sample_failed", exc_info=True)
        await asyncio.sleep(interval_s)


async def start_live_sampler(
    state: State, interval_s: float = SAMPLE_INTERVAL_S
) -> Callable[[], Awaitable[None]]:
    """Start sampling into the app's live history; returns what stops it."""
    history = live_history_of(state)
    history.sampled = True
    task = asyncio.create_task(_run(state, history, interval_s), name="live-sampler")

    async def stop() -> None:
        history.sampled = False
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    return stop
