"""With ``internal_port`` set, /metrics, the admin API and the console answer on it alone and the
public port answers them 404; tenant routes stay off the internal port; health is on both; and
`atrium serve` listens on both ports."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import pytest
from litestar import Litestar
from litestar.testing import AsyncTestClient

from tests.integration.gateway_fakes import make_runtime, make_tenancy, settings
from web.app import create_app
from web.cli.serve import listening_sockets
from web.settings import SettingsError

PUBLIC, INTERNAL = 8000, 9000


async def _statuses(app: Litestar, port: int, paths: list[str]) -> dict[str, int]:
    # The test client runs the app's lifespan, as a server does before it takes requests.
    async with AsyncTestClient(app=app, base_url=f"http://gw.local:{port}") as client:
        return {path: (await client.get(path)).status_code for path in paths}


PATHS = ["/metrics", "/admin/v1/tenants", "/admin/", "/v1/models", "/healthz"]


def test_ops_paths_answer_only_on_the_internal_port(tiny_llama_dir: Path) -> None:
    runtime, _ = make_runtime(tiny_llama_dir)
    app = create_app(settings(internal_port=INTERNAL), engine=runtime, store=make_tenancy())
    public = asyncio.run(_statuses(app, PUBLIC, PATHS))
    internal = asyncio.run(_statuses(app, INTERNAL, PATHS))
    assert public["/metrics"] == public["/admin/v1/tenants"] == public["/admin/"] == 404
    assert internal["/metrics"] == 200
    # Reached the admin API and the console (no database here: 503), not refused by the port.
    assert internal["/admin/v1/tenants"] != 404 and internal["/admin/"] != 404
    assert public["/v1/models"] == 401 and internal["/v1/models"] == 404
    assert public["/healthz"] == internal["/healthz"] == 200


def test_without_it_everything_shares_one_port(tiny_llama_dir: Path) -> None:
    runtime, _ = make_runtime(tiny_llama_dir)
    app = create_app(settings(), engine=runtime, store=make_tenancy())
    public = asyncio.run(_statuses(app, PUBLIC, PATHS))
    assert public["/metrics"] == 200 and public["/admin/v1/tenants"] != 404
    assert listening_sockets(settings()) is None


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_serve_listens_on_both_ports_and_the_setting_is_checked() -> None:
    wanted = [_free_port(), _free_port()]
    sockets = listening_sockets(settings(port=wanted[0], internal_port=wanted[1]))
    assert sockets is not None
    try:
        assert [s.getsockname()[1] for s in sockets] == wanted
        for port in wanted:  # both accept connections
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
    finally:
        for sock in sockets:
            sock.close()
    with pytest.raises(SettingsError):
        settings(internal_port=8000)
    with pytest.raises(SettingsError):
        settings(role="engine", engine_token="t", internal_port=9000)
