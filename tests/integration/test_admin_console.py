"""The console: sign-in, the session cookie, CSRF and cross-site refusals, and its pages."""

from __future__ import annotations

import re

from litestar import Litestar
from litestar.testing import TestClient

from tests.integration.test_admin_app import ADMIN_TOKEN, anon, assert_error, db_url

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


def test_a_forged_or_missing_session_is_refused(anon: Client) -> None:
    sign_in(anon)
    value = anon.cookies.get("atrium_console")
    assert value
    anon.cookies.clear()
    assert_error(anon.get("/admin/v1/tenants"), 401)
    session_id, expires, signature = value.split(".")
    forged = f"{session_id}.{int(expires) + 10**6}.{signature}"
    anon.cookies.set("atrium_console", forged)
    assert_error(anon.get("/admin/v1/tenants"), 401)


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
    assert "acme" in tenants and "1,234,567" in tenants and "25 %" in tenants
    assert "unlimited" in tenants
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
