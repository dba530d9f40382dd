"""Forwarded headers count only from configured proxies: under `atrium serve`'s HTTP server a
loopback client cannot pick its address (to escape the failed-auth limit) or its scheme (to
mark the console cookie Secure), unless its address is in ``forwarded_allow_ips``."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import uvicorn

from tests.integration.test_admin_app import ADMIN_TOKEN, build_admin_app, migrated_sqlite
from web.cli.serve import server_config
from web.settings import Settings, SettingsError
from web.tenancy.auth_limiter import STATE_KEY, FailedAuthLimiter


@contextmanager
def serving(tmp_path: Path, **overrides: object) -> Iterator[httpx.Client]:
    """The admin app under the server `atrium serve` configures, on a free loopback port."""
    url = migrated_sqlite(tmp_path / f"admin-{time.monotonic_ns()}.db")
    settings = Settings.load(
        {"database_url": url, "admin_token": ADMIN_TOKEN, "port": 0, **overrides}, environ={}
    )
    app = build_admin_app(url, settings=settings, **{STATE_KEY: FailedAuthLimiter(20)})
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(server_config(app, settings))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    base = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        with httpx.Client(base_url=base, timeout=10) as client:
            yield client
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def guesses(client: httpx.Client, count: int) -> list[int]:
    """Bad admin tokens, each from a different claimed address."""
    return [
        client.get(
            "/admin/v1/tenants",
            headers={"Authorization": f"Bearer wrong-{n}", "X-Forwarded-For": f"203.0.113.{n}"},
        ).status_code
        for n in range(count)
    ]


def cookie(client: httpx.Client, headers: dict[str, str]) -> str:
    signed_in = client.post("/admin/sign-in", data={"token": ADMIN_TOKEN}, headers=headers)
    assert signed_in.status_code == 303, signed_in.text
    return signed_in.headers["set-cookie"].lower()


HTTPS = {"X-Forwarded-Proto": "https"}


def test_a_loopback_client_cannot_rotate_its_address_past_the_limit(tmp_path: Path) -> None:
    with serving(tmp_path) as client:
        assert guesses(client, 30) == [401] * 20 + [429] * 10


def test_a_loopback_client_cannot_claim_tls(tmp_path: Path) -> None:
    with serving(tmp_path) as client:
        assert "secure" not in cookie(client, HTTPS)


def test_a_configured_proxy_forwards_address_and_scheme(tmp_path: Path) -> None:
    with serving(tmp_path, forwarded_allow_ips="10.0.0.0/8, 127.0.0.1") as client:
        assert guesses(client, 30) == [401] * 30  # thirty clients behind the proxy, once each
        assert "secure" in cookie(client, HTTPS)
        assert "secure" not in cookie(client, {})
    # A proxy elsewhere does not make loopback trusted.
    with serving(tmp_path, forwarded_allow_ips="10.1.2.3") as client:
        assert "secure" not in cookie(client, HTTPS)
        assert guesses(client, 21)[-1] == 429


@pytest.mark.parametrize("value", ["localhost", "10.0.0.0/33", "*,10.0.0.1", "unix:/x"])
def test_forwarded_allow_ips_takes_addresses_and_networks_only(value: str) -> None:
    with pytest.raises(SettingsError, match="forwarded_allow_ips must list"):
        Settings.load({"forwarded_allow_ips": value}, environ={})


def test_the_variable_and_the_default() -> None:
    assert Settings.load({}, environ={}).forwarded_allow_ips is None
    env = {"ATRIUM_FORWARDED_ALLOW_IPS": "192.0.2.1,2001:db8::/32"}
    assert Settings.load({}, environ=env).forwarded_allow_ips == "192.0.2.1,2001:db8::/32"
