"""Console sign-in and sign-out: the admin token buys a signed, HttpOnly, SameSite=Strict cookie."""

from __future__ import annotations

from typing import Any

from litestar import Request, Response, post
from litestar.datastructures import Cookie
from litestar.params import URLEncodedBody
from litestar.response import Redirect

from tenants.server_secrets import verify_admin_token
from web.admin.auth import is_cross_site
from web.admin.context import console_secret, database
from web.admin.session import (
    CSRF_FIELD,
    SESSION_COOKIE,
    SESSION_TTL_S,
    Session,
    csrf_matches,
    issue_session,
    verify_session,
)
from web.console.render import ROOT, render
from web.errors import ApiError

FormData = URLEncodedBody[dict[str, str]]
COOKIE_PATH = "/admin"


async def current_session(request: Request[Any, Any, Any]) -> Session | None:
    return verify_session(await console_secret(request), request.cookies.get(SESSION_COOKIE))


def session_cookie(request: Request[Any, Any, Any], value: str, max_age: int) -> Cookie:
    return Cookie(
        key=SESSION_COOKIE,
        value=value,
        path=COOKIE_PATH,
        max_age=max_age,
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )


def refuse_cross_site(request: Request[Any, Any, Any]) -> None:
    if is_cross_site(request):
        raise ApiError(403, "Cross-site form posts are refused.", code="csrf_failed")


@post("/sign-in", status_code=303)
async def sign_in(request: Request[Any, Any, Any], data: FormData) -> Response[Any]:
    refuse_cross_site(request)
    token = data.get("token", "").strip()
    if not token or not await verify_admin_token(database(request), token):
        return render(
            request, "signin.html", status_code=401, error="That admin token is not valid."
        )
    value = issue_session(await console_secret(request))
    response: Response[Any] = Redirect(ROOT, status_code=303)
    response.set_cookie(session_cookie(request, value, SESSION_TTL_S))
    return response


@post("/sign-out", status_code=303)
async def sign_out(request: Request[Any, Any, Any], data: FormData) -> Response[Any]:
    refuse_cross_site(request)
    session = await current_session(request)
    if session is not None and not csrf_matches(
        await console_secret(request), session, data.get(CSRF_FIELD)
    ):
        raise ApiError(403, "Missing or invalid CSRF token.", code="csrf_failed")
    response: Response[Any] = Redirect(ROOT, status_code=303)
    response.set_cookie(session_cookie(request, "", 0))
    return response
