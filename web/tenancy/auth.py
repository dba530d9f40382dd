"""A tenant key checked at the gateway: the bearer header, the failed-attempt limit, the scope."""

from __future__ import annotations

import functools
from typing import Any

import structlog
from litestar import Request

from tenants.errors import InvalidKeyError
from web.ops.errors import RATE_HEADERS, ApiError
from web.tenancy.auth_limiter import client_address, limiter_of
from web.tenancy.principal import Principal, Tenancy

INFERENCE = "inference"  # the key scope that generation needs


async def authenticate(
    request: Request[Any, Any, Any], tenancy: Tenancy, scope: str | None = None
) -> Principal:
    """The key's principal, as ``tenancy`` finds it; a key without ``scope`` is refused with
    401, as OpenAI refuses a restricted key that lacks a permission."""
    header = request.headers.get("authorization", "")
    scheme, _, secret = header.partition(" ")
    if scheme.lower() != "bearer" or not secret.strip():
        raise ApiError(
            401,
            "You didn't provide an API key: send `Authorization: Bearer <key>`.",
            code="invalid_api_key",
        )
    limiter = limiter_of(request)
    address = client_address(request)
    if limiter is not None:
        limiter.check(address)
    try:
        principal = await tenancy.authenticate(secret.strip())
    except InvalidKeyError:
        if limiter is not None:
            await limiter.fail(address)
        raise
    structlog.contextvars.bind_contextvars(tenant_id=principal.tenant_id)
    # Every later error of this request carries the key's ``x-ratelimit-*`` (web.ops.errors).
    request.state[RATE_HEADERS] = functools.partial(tenancy.rate_headers, principal)
    if scope is not None and scope not in principal.scopes:
        raise ApiError(401, f"This API key lacks the `{scope}` scope.", code="missing_scope")
    return principal
