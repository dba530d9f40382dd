"""The app's shared services as Litestar dependencies: its settings, metrics and engine.

Both app factories register these; a route takes one by naming it as a parameter
(``NamedDependency[...]``) instead of reaching into ``app.state``.
"""

from __future__ import annotations

from typing import Any

from litestar.datastructures import State
from litestar.di import Provide

from web.ops.metrics import GatewayMetrics
from web.settings import Settings


async def provide_settings(state: State) -> Settings:
    settings: Settings = state.settings
    return settings


async def provide_metrics(state: State) -> GatewayMetrics:
    metrics: GatewayMetrics = state.metrics
    return metrics


async def provide_engine(state: State) -> Any:
    """The engine the app runs or calls (None until the lifespan has started it)."""
    return state.get("engine")


def ops_dependencies() -> dict[str, Provide]:
    return {
        "settings": Provide(provide_settings),
        "metrics": Provide(provide_metrics),
        "engine": Provide(provide_engine),
    }
