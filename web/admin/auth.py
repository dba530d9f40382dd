"""The admin guard: a bearer admin token, or a console session (with its CSRF token to change).

Who passed is left on ``connection.state.admin_actor`` for the audit log.
"""

from __future__ import annotations

from typing import Any

from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler

from tenants.server_secrets import verify_admin_token
from web.admin.context import database
from web.admin.session import CSRF_HEADER, csrf_matches, current_session
from web.ops.errors import ApiError
from web.tenancy.auth_limiter import client_address, limiter_of

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
TOKEN_ACTOR = "admin-token"
CONSOLE_ACTOR = "console"


def unauthorized(message: str = "A valid admin token is required.") -> ApiError:
    return ApiError(
        401, message, code="invalid_admin_token", headers={"WWW-Authenticate": "Bearer"}
    )


def forbidden(message: str) -> ApiError:
    return ApiError(403, message, code="csrf_failed")


def bearer_token(connection: ASGIConnection[Any, Any, Any, Any]) -> str | None:
    header = connection.headers.get("authorization")
    if header is None:
        return None
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return ""
    return token.strip()


def is_cross_site(connection: ASGIConnection[Any, Any, Any, Any]) -> bool:
    """True when the browser says the request comes from another site (or origin)."""
    if connection.headers.get("sec-fetch-site", "").lower() == "cross-site":
        return True
    origin = connection.headers.get("origin")
    if origin is None or origin == "null":
        return origin == "null"
    host = connection.headers.get("host", "")
    return origin.split("://", 1)[-1].rstrip("/") != host


async def admin_actor(connection: ASGIConnection[Any, Any, Any, Any]) -> str:
    """Who is asking, or an ApiError (401 without credentials, 403 on a forged console call)."""
    token = bearer_token(connection)
    if token is not None:
        limiter, address = limiter_of(connection), client_address(connection)
        if limiter is not None:
            limiter.check(address)
        if token and await verify_admin_token(database(connection), token):
            return TOKEN_ACTOR
        if limiter is not None:
            limiter.record_failure(address)
        raise unauthorized("Incorrect admin token provided.")
    session = await current_session(connection)
    if session is None:
        raise unauthorized()
    if connection.scope.get("method", "GET") not in SAFE_METHODS:
        if is_cross_site(connection):
            raise forbidden("Cross-site requests are refused.")
        if not csrf_matches(session, connection.headers.get(CSRF_HEADER)):
            raise forbidden("Missing or invalid CSRF token.")
    return CONSOLE_ACTOR


async def admin_guard(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
    connection.state.admin_actor = await admin_actor(connection)
