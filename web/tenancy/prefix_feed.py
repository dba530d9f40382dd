"""The published public prefixes as engines fetch them: the gateway's internal endpoint, and the
engine side that polls it (``follow_public_prefixes``), for engines that have no database.

``GET /internal/v1/public-prefixes`` answers only ``Authorization: Bearer <engine token>``
(compared in constant time; tenant keys and the admin token are refused like any other: 401).
The body is ``{"version", "prefixes": [{"id", "text"}]}`` with the version as ``ETag``; a request
whose ``If-None-Match`` names the current version gets an empty 304.
"""

from __future__ import annotations

import asyncio
import hmac
from typing import TYPE_CHECKING, Any

import httpx
import msgspec
import structlog
from litestar import Request, Response, Router, get
from litestar.connection import ASGIConnection
from litestar.di import NamedDependency
from litestar.handlers.base import BaseRouteHandler

from engine.errors import EngineDeadError
from engine.public_prefix_sync import PrefixEntry, PublicPrefixSync
from tenants.domain import TenantDomain
from web.ops.errors import ApiError
from web.tenancy.auth_limiter import client_address, limiter_of
from web.tenancy.prefix_delivery import local_engine

if TYPE_CHECKING:
    from engine.async_engine import EngineClient

log = structlog.get_logger("atrium.prefix_feed")
FEED_PATH = "/internal/v1/public-prefixes"
FETCH_TIMEOUT_S = 10.0


class FeedPrefix(msgspec.Struct):
    id: str
    text: str


class Feed(msgspec.Struct):
    version: str
    prefixes: list[FeedPrefix]


async def _engine_token_guard(
    connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler
) -> None:
    expected = (getattr(connection.app.state.settings, "engine_token", None) or "").encode()
    scheme, _sep, given = connection.headers.get("authorization", "").partition(" ")
    # Bytes: compare_digest refuses non-ASCII strings, and any caller can send them.
    given_bytes = given.strip().encode("utf-8", "backslashreplace")
    limiter, address = limiter_of(connection), client_address(connection)
    if limiter is not None:
        limiter.check(address)  # 429 after too many failures from one address
    if not expected or scheme.lower() != "bearer" or not hmac.compare_digest(given_bytes, expected):
        if limiter is not None:
            await limiter.fail(address)
        raise ApiError(
            401,
            "Only engines may read this: send `Authorization: Bearer <engine token>`.",
            code="invalid_engine_token",
            headers={"WWW-Authenticate": "Bearer"},
        )


def _quoted(version: str) -> str:
    return f'"{version}"'


@get(FEED_PATH, include_in_schema=False)
async def published_prefixes(
    request: Request[Any, Any, Any], tenant_domain: NamedDependency[TenantDomain | None]
) -> Response[Any]:
    domain = tenant_domain
    if not isinstance(domain, TenantDomain):
        raise ApiError(503, "This gateway has no database.", code="database_unavailable")
    published = await domain.public_prefixes.published()
    etag = _quoted(published.version)
    seen = [tag.strip() for tag in request.headers.get("if-none-match", "").split(",")]
    if etag in seen:
        return Response(content=b"", status_code=304, headers={"ETag": etag})
    body = Feed(published.version, [FeedPrefix(p.id, p.text) for p in published.prefixes])
    return Response(content=msgspec.json.encode(body), headers={"ETag": etag})


internal_router = Router(
    path="/", route_handlers=[published_prefixes], guards=[_engine_token_guard]
)


async def follow_public_prefixes(
    engine: EngineClient,
    gateway_url: str,
    engine_token: str,
    *,
    poll_s: float = 5.0,
    sync: PublicPrefixSync | None = None,
    client: httpx.AsyncClient | None = None,
) -> None:
    """Keep ``engine``'s public prefixes equal to what the gateway at ``gateway_url`` publishes:
    fetch now and every ``poll_s`` seconds (a 304 costs nothing), until cancelled. Failures are
    logged and retried at the next poll; a dead engine ends it."""
    sync = sync or PublicPrefixSync(engine)
    own = client is None
    http = client or httpx.AsyncClient(timeout=FETCH_TIMEOUT_S)
    url = gateway_url.rstrip("/") + FEED_PATH
    try:
        while True:
            headers = {"Authorization": f"Bearer {engine_token}"}
            if sync.version is not None:
                headers["If-None-Match"] = _quoted(sync.version)
            try:
                answer = await http.get(url, headers=headers)
                if answer.status_code == 200:
                    feed = msgspec.json.decode(answer.content, type=Feed)
                    entries = [PrefixEntry(p.id, p.text) for p in feed.prefixes]
                    await sync.apply(entries, feed.version)
                elif answer.status_code != 304:
                    log.warning("public_prefix_feed_refused", status=answer.status_code)
            except EngineDeadError:
                raise
            except Exception as exc:  # the gateway away or a bad answer: again at the next poll
                log.warning("public_prefix_feed_failed", error=repr(exc))
            await asyncio.sleep(poll_s)
    finally:
        if own:
            await http.aclose()


def start_following(
    engine: object, gateway_url: str | None, engine_token: str | None, poll_s: float = 5.0
) -> asyncio.Task[None] | None:
    """For the engine role: follow ``gateway_url``'s published prefixes in a background task
    (cancel it to stop), or None when no gateway is named or the engine is not in this process
    tree. Call it from the running event loop, once the engine has started."""
    client = local_engine(engine)
    if not gateway_url or not engine_token or client is None:
        return None
    log.info("public_prefixes_followed", gateway_url=gateway_url, poll_s=poll_s)
    return asyncio.create_task(
        follow_public_prefixes(client, gateway_url, engine_token, poll_s=poll_s),
        name="atrium-public-prefix-feed",
    )
