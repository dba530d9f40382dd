"""The console: sign-in, server-side sessions and their cookie, CSRF and cross-site refusals,
and its pages."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import re
import secrets
import time
from datetime import UTC, datetime, timedelta

from litestar import Litestar
from litestar.testing import TestClient
from sqlalchemy import select, update

from tenants.database import Database
from tenants.models import ConsoleSessionRow, Setting
from tenants.server_secrets import ensure_admin_token
from tests.integration.test_admin_app import (
    ADMIN_TOKEN,
    anon,
    assert_error,
    build_admin_app,
    db_url,
)
from web.settings import Settings

__all__ = ["anon", "db_url"]  # fixtures used below
Client = TestClient[Litestar]


def sign_in(client: Client) -> str:
    """Sign in and return the page's CSRF token."""
    response = client.post("/admin/sign-in", data={"token": ADMIN_TOKEN}, follow_redirects=False)
    assert response.status_code == 303
    page = client.get("/admin/")
    match = re.search(r'<meta name="csrf-token" content="([^"]+)">', page.text)
    assert match, page.text
    return match.group(1)


def test_the_console_asks_for_the_admin_token(anon: Client) -> None:
    page = anon.get("/admin/")
    assert page.status_code == 200 and 'name="token"' in page.text
    wrong = anon.post("/admin/sign-in", data={"token": "nope"}, follow_redirects=False)
    assert wrong.status_code == 401 and "not valid" in wrong.text
    assert "set-cookie" not in wrong.headers
    for path in ("/admin/tenants", "/admin/keys", "/admin/usage", "/admin/billing", "/admin/audit"):
        response = anon.get(path, follow_redirects=False)
        assert response.status_code == 303 and response.headers["location"] == "/admin/"


def test_sign_in_sets_a_strict_http_only_session_cookie(anon: Client) -> None:
    response = anon.post("/admin/sign-in", data={"token": ADMIN_TOKEN}, follow_redirects=False)
    cookie = response.headers["set-cookie"].lower()
    assert "httponly" in cookie and "samesite=strict" in cookie and "path=/admin" in cookie
    assert ADMIN_TOKEN.lower() not in cookie
    page = anon.get("/admin/")
    assert "Overview" in page.text and "Sign out" in page.text


def test_the_api_takes_the_session_but_changes_need_the_csrf_header(anon: Client) -> None:
    csrf = sign_in(anon)
    assert anon.get("/admin/v1/tenants").json() == []
    assert_error(anon.post("/admin/v1/tenants", json={"name": "acme"}), 403, "csrf_failed")
    bad = anon.post("/admin/v1/tenants", json={"name": "acme"}, headers={"X-CSRF-Token": "x"})
    assert_error(bad, 403)
    cross = anon.post(
        "/admin/v1/tenants",
        json={"name": "acme"},
        headers={"X-CSRF-Token": csrf, "Origin": "https://evil.example"},
    )
    assert_error(cross, 403)
    ok = anon.post("/admin/v1/tenants", json={"name": "acme"}, headers={"X-CSRF-Token": csrf})
    assert ok.status_code == 201
    assert [e["actor"] for e in anon.get("/admin/v1/audit").json()] == ["console"]


def test_a_forged_or_missing_session_is_refused(anon: Client, db_url: str) -> None:
    sign_in(anon)
    value = anon.cookies.get("atrium_console")
    assert value
    anon.cookies.clear()
    assert_error(anon.get("/admin/v1/tenants"), 401)
    for forged in _forgeries_from_the_database(db_url):
        anon.cookies.set("atrium_console", forged, path="/admin")
        assert_error(anon.get("/admin/v1/tenants"), 401)
        created = anon.post(
            "/admin/v1/tenants", json={"name": "forged"}, headers={"X-CSRF-Token": forged}
        )
        assert_error(created, 401)
        assert 'name="token"' in anon.get("/admin/").text
    anon.cookies.set("atrium_console", value, path="/admin")
    assert anon.get("/admin/v1/tenants").json() == []  # nobody created a tenant


def _forgeries_from_the_database(url: str) -> list[str]:
    """Cookies someone holding a copy of the database could make: signed with every secret it
    stores (as console cookies once were), or its session rows presented as ids."""

    async def read() -> tuple[list[str], list[str]]:
        db = await Database.connect(url)
        try:
            async with db.sessions() as session:
                settings = list(await session.scalars(select(Setting.value)))
                rows = list(await session.execute(select(ConsoleSessionRow)))
            return settings, [v for (row,) in rows for v in (row.id_hash, row.admin_binding)]
        finally:
            await db.close()

    settings, stored = asyncio.run(read())
    forged = []
    expires = int(time.time()) + 10 * 365 * 86400
    for value in settings:
        bases = [value.encode()]
        if re.fullmatch(r"(?:[0-9a-f]{2})+", value):
            bases.append(bytes.fromhex(value))
        for base in bases:
            key = hmac.new(base, b"atrium console session", hashlib.sha256).digest()
            body = f"{secrets.token_urlsafe(18)}.{expires}"
            mac = hmac.new(key, f"session:{body}".encode(), hashlib.sha256).digest()
            forged.append(f"{body}.{base64.urlsafe_b64encode(mac).rstrip(b'=').decode()}")
    return forged + stored


def test_a_signed_out_cookie_replayed_is_refused(anon: Client) -> None:
    csrf = sign_in(anon)
    value = anon.cookies.get("atrium_console")
    assert value
    anon.post("/admin/sign-out", data={"csrf_token": csrf}, follow_redirects=False)
    anon.cookies.set("atrium_console", value, path="/admin")  # a copy kept from before
    assert_error(anon.get("/admin/v1/tenants"), 401)
    refused = anon.post("/admin/v1/tenants", json={"name": "x"}, headers={"X-CSRF-Token": csrf})
    assert_error(refused, 401)


def test_a_new_admin_token_ends_console_sessions(anon: Client, db_url: str) -> None:
    sign_in(anon)
    assert anon.get("/admin/v1/tenants").status_code == 200
    asyncio.run(_set_admin_token(db_url, "a-rotated-admin-token-987654321"))
    assert_error(anon.get("/admin/v1/tenants"), 401)
    assert 'name="token"' in anon.get("/admin/").text


def test_a_session_ends_at_its_end_whatever_the_cookie_says(anon: Client, db_url: str) -> None:
    sign_in(anon)
    assert anon.get("/admin/v1/tenants").status_code == 200

    async def expire() -> None:
        db = await Database.connect(db_url)
        try:
            async with db.transaction() as session:
                past = datetime.now(UTC) - timedelta(seconds=1)
                await session.execute(update(ConsoleSessionRow).values(expires_at=past))
        finally:
            await db.close()

    asyncio.run(expire())
    assert_error(anon.get("/admin/v1/tenants"), 401)


async def _set_admin_token(url: str, token: str) -> None:
    db = await Database.connect(url)
    try:
        await ensure_admin_token(db, token)
    finally:
        await db.close()


def _session_cookie(client: Client, headers: dict[str, str] | None = None) -> str:
    response = client.post(
        "/admin/sign-in", data={"token": ADMIN_TOKEN}, headers=headers, follow_redirects=False
    )
    assert response.status_code == 303
    return str(response.headers["set-cookie"]).lower()


def test_the_cookie_is_secure_over_tls_and_behind_a_trusted_proxy_only(db_url: str) -> None:
    https = {"X-Forwarded-Proto": "https"}
    with TestClient(build_admin_app(db_url)) as plain:
        assert "secure" not in _session_cookie(plain)
        assert "secure" not in _session_cookie(plain, https)  # anyone can send the header
    with TestClient(build_admin_app(db_url), base_url="https://testserver.local") as tls:
        assert "secure" in _session_cookie(tls)
    trusting = Settings(database_url=db_url, admin_token=ADMIN_TOKEN, trust_forwarded_proto=True)
    with TestClient(build_admin_app(db_url, settings=trusting)) as proxied:
        assert "secure" in _session_cookie(proxied, https)
        assert "secure" in _session_cookie(proxied, {"X-Forwarded-Proto": "http, https"})
        assert "secure" not in _session_cookie(proxied, {"X-Forwarded-Proto": "http"})
        assert "secure" not in _session_cookie(proxied)


def test_cross_site_form_posts_are_refused(anon: Client) -> None:
    csrf = sign_in(anon)
    evil = {"Origin": "https://evil.example"}
    response = anon.post("/admin/sign-in", data={"token": ADMIN_TOKEN}, headers=evil)
    assert_error(response, 403)
    form_post = anon.post("/admin/v1/tenants", data={"name": "x"}, headers=evil)
    assert_error(form_post, 403)
    sign_out = anon.post("/admin/sign-out", data={"csrf_token": csrf}, headers=evil)
    assert_error(sign_out, 403)
    assert_error(anon.post("/admin/sign-out", data={"csrf_token": "forged"}), 403)


def test_sign_out_clears_the_session(anon: Client) -> None:
    csrf = sign_in(anon)
    response = anon.post("/admin/sign-out", data={"csrf_token": csrf}, follow_redirects=False)
    assert response.status_code == 303
    assert 'name="token"' in anon.get("/admin/").text
    assert_error(anon.get("/admin/v1/tenants"), 401)


def test_pages_show_the_operators_data(anon: Client) -> None:
    csrf = sign_in(anon)
    headers = {"X-CSRF-Token": csrf}
    quotas = {"tokens_per_minute": 1234567, "kv_cache_share": 0.25}
    tenant = anon.post(
        "/admin/v1/tenants", json={"name": "acme", "quotas": quotas}, headers=headers
    ).json()
    anon.post(f"/admin/v1/tenants/{tenant['id']}/keys", json={"name": "ci"}, headers=headers)
    anon.put(
        "/admin/v1/prices/tiny",
        json={
            "input_per_million": 1_500_000,
            "cached_input_per_million": 0,
            "output_per_million": 2_000_000,
        },
        headers=headers,
    )
    tenants = anon.get("/admin/tenants").text
    assert "acme" in tenants and f'href="/admin/tenants/{tenant["id"]}"' in tenants
    assert "no limit" in tenants  # neither budget is set
    detail = anon.get(f"/admin/tenants/{tenant['id']}").text
    assert "1,234,567 tokens" in detail and "25 %" in detail and "ci" in detail
    assert "No requests this month" in detail and "No batches" in detail
    assert anon.get("/admin/tenants/tn_missing").status_code == 404
    assert "No batches" in anon.get("/admin/batches").text
    keys = anon.get("/admin/keys", params={"tenant_id": tenant["id"]}).text
    assert "ci" in keys and "Revoke" in keys
    billing = anon.get("/admin/billing").text
    assert "1.50" in billing and "2.00" in billing
    audit = anon.get("/admin/audit").text
    assert "tenant.create" in audit and "key.create" in audit and "price.set" in audit
    usage = anon.get("/admin/usage").text
    assert "chart.umd.min.js" in usage and "acme" in usage


def test_empty_states_and_assets(anon: Client) -> None:
    sign_in(anon)
    assert "No tenants yet" in anon.get("/admin/tenants").text
    assert "No tenants yet" in anon.get("/admin/keys").text
    assert "No prices set" in anon.get("/admin/billing").text
    chart = anon.get("/admin/static/vendor/chart.umd.min.js")
    assert chart.status_code == 200 and "Chart" in chart.text
    css = anon.get("/admin/static/console/console.css")
    assert css.status_code == 200 and "--accent" in css.text
