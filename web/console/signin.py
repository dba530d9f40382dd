"""Console sign-in and sign-out: the admin token buys a server-side session in an HttpOnly,
SameSite=Strict cookie (Secure over TLS); signing out ends it on the server."""

from __future__ import annotations

from typing import Any

from litestar import Request, Response, post
from litestar.datastructures import Cookie
from litestar.params import URLEncodedBody
from litestar.response import Redirect

from web.admin.auth import is_cross_site
from web.admin.session import (
    CSRF_FIELD,
    SESSION_COOKIE,
    console_sessions,
    csrf_matches,
    current_session,
    is_https,
)
from web.console.render import ROOT, render
from web.ops.errors import ApiError
from web.tenancy.auth_limiter import client_address, limiter_of

FormData = URLEncodedBody[dict[str, str]]
COOKIE_PATH = "/admin"


def session_cookie(request: Request[Any, Any, Any], value: str, max_age: int) -> Cookie:
    return Cookie(
        key=SESSION_COOKIE,
        value=value,
        path=COOKIE_PATH,
        max_age=max_age,
        httponly=True,
        samesite="strict",
        secure=is_https(request),
    )


def refuse_cross_site(request: Request[Any, Any, Any]) -> None:
    if is_cross_site(request):
        raise ApiError(403, "Cross-site form posts are refused.", code="csrf_failed")


@post("/sign-in", status_code=303)
async def sign_in(request: Request[Any, Any, Any], data: FormData) -> Response[Any]:
    refuse_cross_site(request)
    limiter, address = limiter_of(request), client_address(request)
    if limiter is not None:
        limiter.check(address)
    token = data.get("token", "").strip()
    sessions = console_sessions(request)
    session = await sessions.sign_in(token) if token else None
    if session is None:
        if limiter is not None:
            limiter.record_failure(address)
        return render(
            request, "signin.html", status_code=401, error="That admin token is not valid."
        )
    response: Response[Any] = Redirect(ROOT, status_code=303)
    max_age = int(sessions.ttl.total_seconds())
    response.set_cookie(session_cookie(request, session.session_id, max_age))
    return response


@post("/sign-out", status_code=303)
async def sign_out(request: Request[Any, Any, Any], data: FormData) -> Response[Any]:
    refuse_cross_site(request)
    session = await current_session(request)
    if session is not None and not csrf_matches(session, data.get(CSRF_FIELD)):
        raise ApiError(403, "Missing or invalid CSRF token.", code="csrf_failed")
    # Ended server-side: a copy of the cookie is worth nothing from now on.
    await console_sessions(request).sign_out(session.session_id if session else None)
    response: Response[Any] = Redirect(ROOT, status_code=303)
    response.set_cookie(session_cookie(request, "", 0))
    return response
