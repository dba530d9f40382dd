"""The console session at the HTTP edge: its cookie, the session it names, its CSRF token.

The cookie carries only a random session id, checked against the server-side table
(`tenants/console_sessions.py`). The CSRF token is an HMAC keyed by that id, so it is worthless
without the matching cookie, dies with it, and nothing the server stores can produce it.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from typing import Any

from litestar.connection import ASGIConnection

from tenants.console_sessions import ConsoleSession, ConsoleSessions
from web.admin.context import app_state, database

SESSION_COOKIE = "atrium_console"
CSRF_FIELD = "csrf_token"
CSRF_HEADER = "x-csrf-token"
SESSIONS_STATE = "console_sessions"


def console_sessions(connection: ASGIConnection[Any, Any, Any, Any]) -> ConsoleSessions:
    """The app's session store (a test may leave one with its own clock on ``app.state``)."""
    state = app_state(connection)
    cached = state.get(SESSIONS_STATE)
    if isinstance(cached, ConsoleSessions):
        return cached
    store = ConsoleSessions(database(connection))
    state[SESSIONS_STATE] = store
    return store


async def current_session(connection: ASGIConnection[Any, Any, Any, Any]) -> ConsoleSession | None:
    """The live session the request's cookie names, or None."""
    return await console_sessions(connection).check(connection.cookies.get(SESSION_COOKIE))


def is_https(connection: ASGIConnection[Any, Any, Any, Any]) -> bool:
    """Whether the browser reached us over TLS: the request's own scheme, or the last
    ``X-Forwarded-Proto`` hop when the settings say a TLS proxy in front sets it."""
    if connection.url.scheme == "https":
        return True
    settings = app_state(connection).get("settings")
    if not getattr(settings, "trust_forwarded_proto", False):
        return False
    forwarded = connection.headers.get("x-forwarded-proto", "")
    return forwarded.rsplit(",", 1)[-1].strip().lower() == "https"


def _same(expected: str, candidate: str) -> bool:
    """Constant-time equality that any client string can reach: ``compare_digest`` refuses
    non-ASCII ``str`` with a TypeError, so both sides are compared as UTF-8 bytes."""
    as_bytes = candidate.encode("utf-8", "backslashreplace")
    return hmac.compare_digest(expected.encode("ascii"), as_bytes)


def csrf_token(session: ConsoleSession) -> str:
    """The CSRF token forms and fetch calls must echo back for this session."""
    key = session.session_id.encode("utf-8")
    digest = hmac.new(key, b"atrium console csrf", hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode("ascii")


def csrf_matches(session: ConsoleSession, candidate: str | None) -> bool:
    """Constant-time check of a submitted CSRF token."""
    if not candidate:
        return False
    return _same(csrf_token(session), candidate)
