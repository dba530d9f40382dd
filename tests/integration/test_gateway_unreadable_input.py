"""Bytes msgspec or hmac cannot read (bad UTF-8, deep nesting, non-ASCII cookies) are 4xx."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from litestar import Litestar
from litestar.testing import TestClient
from structlog.testing import capture_logs

from tests.integration.gateway_fakes import KEY_A, MODEL, make_runtime, make_tenancy
from tests.integration.gateway_fakes import settings as gateway_settings
from tests.integration.test_admin_app import ADMIN_TOKEN, anon, assert_error, db_url
from tests.integration.test_admin_console import sign_in
from web.app import create_app

__all__ = ["anon", "db_url"]  # fixtures used below
Client = TestClient[Litestar]
AUTH = {"Authorization": f"Bearer {KEY_A}", "content-type": "application/json"}
NOT_UTF8 = b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "\xff\xfe"}]}'
DEEP = b'{"model": "tiny-llama", "messages": [], "x": ' + b"[" * 1000 + b"]" * 1000 + b"}"
TEXT_DEEP = b'{"model": "tiny-llama", "prompt": "hi", "x": ' + b'{"a": ' * 1000 + b"1" + b"}" * 1001
NON_ASCII_COOKIE = "atrium_console=abc.9999999999.sig\xe9".encode("latin-1")
# A template that refuses a conversation, the way Llama 2's and Mistral's do.
REFUSING_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}{{ m['content'] }}{% endfor %}"
)


@pytest.fixture(scope="module")
def gateway(tiny_llama_dir: Path) -> Iterator[Client]:
    runtime, _ = make_runtime(tiny_llama_dir)
    runtime.tokenizer.hf.chat_template = REFUSING_TEMPLATE  # type: ignore[attr-defined]
    app = create_app(gateway_settings(), engine=runtime, store=make_tenancy(), include_admin=False)
    with TestClient(app) as client:
        yield client


def no_error_logs(logs: list[dict[str, Any]]) -> None:
    assert [entry for entry in logs if entry["log_level"] in ("error", "critical")] == []


@pytest.mark.parametrize(
    ("path", "body", "phrase"),
    [
        ("/v1/chat/completions", NOT_UTF8, "UTF-8"),
        ("/v1/chat/completions", DEEP, "nested"),
        ("/v1/completions", TEXT_DEEP, "nested"),
        ("/v1/completions", b'{"model": "tiny-llama", "prompt": "\xc3"}', "UTF-8"),
    ],
)
def test_unreadable_openai_bodies_are_400(
    gateway: Client, path: str, body: bytes, phrase: str
) -> None:
    with capture_logs() as logs:
        response = gateway.post(path, content=body, headers=AUTH)
    error = assert_error(response, 400, "invalid_json")
    assert phrase in error["message"]
    no_error_logs(logs)


def test_a_chat_template_that_raises_is_a_400(gateway: Client) -> None:
    body = {"model": MODEL, "messages": [{"role": "system", "content": "be terse"}]}
    with capture_logs() as logs:
        response = gateway.post("/v1/chat/completions", json=body, headers=AUTH)
    error = assert_error(response, 400, "invalid_request")
    assert error["param"] == "messages" and "System role not supported" in error["message"]
    no_error_logs(logs)
    ok = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert gateway.post("/v1/chat/completions", json=ok, headers=AUTH).status_code == 200


@pytest.mark.parametrize("body", [b'{"name": "\xff"}', b"[" * 1000 + b"]" * 1000])
def test_unreadable_admin_bodies_are_400(anon: Client, body: bytes) -> None:
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}", "content-type": "application/json"}
    with capture_logs() as logs:
        response = anon.post("/admin/v1/tenants", content=body, headers=headers)
    assert_error(response, 400, "invalid_json")
    no_error_logs(logs)
    assert anon.get("/admin/v1/tenants", headers=headers).json() == []


@pytest.mark.parametrize("path", ["/admin/v1/tenants", "/admin/v1/audit", "/admin/v1/engine"])
def test_a_non_ascii_session_cookie_is_401(anon: Client, path: str) -> None:
    with capture_logs() as logs:
        response = anon.get(path, headers={"cookie": NON_ASCII_COOKIE})  # type: ignore[dict-item]
    assert_error(response, 401, "invalid_admin_token")
    no_error_logs(logs)


def test_the_console_treats_a_non_ascii_cookie_as_signed_out(anon: Client) -> None:
    page = anon.get("/admin/", headers={"cookie": NON_ASCII_COOKIE})  # type: ignore[dict-item]
    assert page.status_code == 200 and 'name="token"' in page.text


def test_a_non_ascii_csrf_token_is_refused(anon: Client) -> None:
    csrf = sign_in(anon)
    forged = ("\xe9" * len(csrf)).encode("latin-1")
    with capture_logs() as logs:
        response = anon.post(
            "/admin/v1/tenants", json={"name": "acme"}, headers={"X-CSRF-Token": forged}
        )  # type: ignore[dict-item]
    assert_error(response, 403, "csrf_failed")
    no_error_logs(logs)
    signed_out = anon.post(
        "/admin/sign-out",
        content=b"csrf_token=%C3%A9",
        headers={"content-type": "application/x-www-form-urlencoded"},
    )
    assert_error(signed_out, 403, "csrf_failed")
    assert anon.get("/admin/v1/tenants").json() == []
