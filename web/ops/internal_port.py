"""The internal port: with ``internal_port`` set, /metrics, the admin API and the console answer
only there, and the public port answers them 404 (the public Service never exposes them).

The port a request came in on is the one in its ASGI scope's ``server``; health checks answer on
both ports, everything else on the public port only.
"""

from __future__ import annotations

from collections.abc import Callable

from litestar.enums import ScopeType
from litestar.types import ASGIApp, Receive, Scope, Send

from web.ops.errors import ApiError

INTERNAL_PREFIXES = ("/metrics", "/admin")
EVERYWHERE = ("/healthz", "/readyz")


def is_internal(path: str) -> bool:
    return any(path == p or path.startswith(p + "/") for p in INTERNAL_PREFIXES)


def internal_port_guard(internal_port: int) -> Callable[[ASGIApp], ASGIApp]:
    """A Litestar middleware that keeps ops paths to ``internal_port`` and the rest off it."""

    def middleware(app: ASGIApp) -> ASGIApp:
        async def guarded(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] == ScopeType.HTTP and scope["path"] not in EVERYWHERE:
                server = scope.get("server")
                on_internal = server is not None and server[1] == internal_port
                if is_internal(scope["path"]) != on_internal:
                    raise ApiError(404, "Not found.", code="not_found")
            await app(scope, receive, send)

        return guarded

    return middleware
