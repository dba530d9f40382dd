"""Signed console session cookies and the CSRF tokens bound to them (stateless, HMAC-SHA256).

A session value is ``<session id>.<expires unix>.<signature>``; its CSRF token is an HMAC of the
session id, so a token is worthless without the matching cookie and dies with it.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
import time
from typing import NamedTuple

SESSION_COOKIE = "atrium_console"
CSRF_FIELD = "csrf_token"
CSRF_HEADER = "x-csrf-token"
SESSION_TTL_S = 8 * 3600


class Session(NamedTuple):
    """A verified console session."""

    session_id: str
    expires_at: int


def _mac(secret: bytes, purpose: str, message: str) -> str:
    digest = hmac.new(secret, f"{purpose}:{message}".encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode("ascii")


def _same(expected: str, candidate: str) -> bool:
    """Constant-time equality that any client string can reach: ``compare_digest`` refuses
    non-ASCII ``str`` with a TypeError, so both sides are compared as UTF-8 bytes."""
    as_bytes = candidate.encode("utf-8", "backslashreplace")
    return hmac.compare_digest(expected.encode("ascii"), as_bytes)


def issue_session(secret: bytes, now: float | None = None, ttl_s: int = SESSION_TTL_S) -> str:
    """A new signed cookie value valid for ``ttl_s`` seconds."""
    session_id = secrets.token_urlsafe(18)
    expires_at = int(now if now is not None else time.time()) + ttl_s
    body = f"{session_id}.{expires_at}"
    return f"{body}.{_mac(secret, 'session', body)}"


def verify_session(secret: bytes, value: str | None, now: float | None = None) -> Session | None:
    """The session a cookie value carries, or None when it is absent, forged or expired."""
    if not value:
        return None
    parts = value.split(".")
    if len(parts) != 3:
        return None
    session_id, expires_raw, signature = parts
    expected = _mac(secret, "session", f"{session_id}.{expires_raw}")
    if not _same(expected, signature):
        return None
    try:
        expires_at = int(expires_raw)
    except ValueError:
        return None
    if expires_at <= (now if now is not None else time.time()):
        return None
    return Session(session_id=session_id, expires_at=expires_at)


def csrf_token(secret: bytes, session: Session) -> str:
    """The CSRF token forms and fetch calls must echo back for this session."""
    return _mac(secret, "csrf", session.session_id)


def csrf_matches(secret: bytes, session: Session, candidate: str | None) -> bool:
    """Constant-time check of a submitted CSRF token."""
    if not candidate:
        return False
    return _same(csrf_token(secret, session), candidate)
