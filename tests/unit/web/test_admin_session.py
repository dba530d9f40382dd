"""Console CSRF tokens: bound to one session id, and refused (never raised on) when garbled."""

from __future__ import annotations

import hashlib
import hmac
from datetime import UTC, datetime

from tenants.console_sessions import ConsoleSession
from web.admin.session import csrf_matches, csrf_token

AT = datetime(2031, 1, 1, tzinfo=UTC)
FIRST = ConsoleSession("first-session-id-" + "a" * 26, AT)
SECOND = ConsoleSession("second-session-id-" + "b" * 25, AT)


def test_csrf_tokens_belong_to_one_session() -> None:
    token = csrf_token(FIRST)
    assert csrf_matches(FIRST, token)
    assert not csrf_matches(SECOND, token)
    assert not csrf_matches(FIRST, None)
    assert not csrf_matches(FIRST, "")
    assert not csrf_matches(FIRST, token[:-1])


def test_the_token_is_keyed_by_the_session_id_alone() -> None:
    # Neither the stored hash of the id nor any server secret yields the token.
    stored = hashlib.sha256(FIRST.session_id.encode()).hexdigest()
    from_hash = hmac.new(stored.encode(), b"atrium console csrf", hashlib.sha256).hexdigest()
    assert csrf_token(FIRST) != csrf_token(ConsoleSession(stored, AT))
    assert not csrf_matches(FIRST, from_hash)


def test_non_ascii_tokens_are_refused_not_raised() -> None:
    assert not csrf_matches(FIRST, "é" * len(csrf_token(FIRST)))
    assert not csrf_matches(FIRST, "\udcff")
    assert not csrf_matches(FIRST, "🙂")
