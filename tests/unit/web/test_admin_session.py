"""Console session cookies and CSRF tokens: signed, expiring, bound to one session."""

from __future__ import annotations

from web.admin.session import csrf_matches, csrf_token, issue_session, verify_session

SECRET = b"s" * 32


def test_a_session_verifies_until_it_expires() -> None:
    value = issue_session(SECRET, now=1_000, ttl_s=60)
    session = verify_session(SECRET, value, now=1_059)
    assert session is not None and session.expires_at == 1_060
    assert verify_session(SECRET, value, now=1_060) is None


def test_tampered_or_foreign_sessions_are_refused() -> None:
    value = issue_session(SECRET, now=1_000)
    session_id, expires, signature = value.split(".")
    assert verify_session(SECRET, f"{session_id}.{int(expires) + 1}.{signature}", now=1_000) is None
    assert verify_session(SECRET, f"other.{expires}.{signature}", now=1_000) is None
    assert verify_session(b"t" * 32, value, now=1_000) is None
    for junk in (None, "", "a.b", "a.b.c.d", f"{session_id}.soon.{signature}"):
        assert verify_session(SECRET, junk, now=1_000) is None


def test_csrf_tokens_belong_to_one_session() -> None:
    first = verify_session(SECRET, issue_session(SECRET, now=1_000), now=1_000)
    second = verify_session(SECRET, issue_session(SECRET, now=1_000), now=1_000)
    assert first is not None and second is not None
    token = csrf_token(SECRET, first)
    assert csrf_matches(SECRET, first, token)
    assert not csrf_matches(SECRET, second, token)
    assert not csrf_matches(SECRET, first, None)
    assert not csrf_matches(SECRET, first, token[:-1])


def test_non_ascii_cookies_and_tokens_are_refused_not_raised() -> None:
    value = issue_session(SECRET, now=1_000)
    session_id, expires, _ = value.split(".")
    for signature in ("é" * 43, "\udcff", "🙂"):
        assert verify_session(SECRET, f"{session_id}.{expires}.{signature}", now=1_000) is None
    session = verify_session(SECRET, value, now=1_000)
    assert session is not None
    assert not csrf_matches(SECRET, session, "é" * len(csrf_token(SECRET, session)))
    assert not csrf_matches(SECRET, session, "\udcff")
