"""Admin API fixtures on a migrated SQLite database, and the guard in front of every route."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from litestar import Litestar
from litestar.datastructures import State
from litestar.testing import TestClient

from tenants.database import Database
from tenants.server_secrets import ensure_admin_token
from web.admin import admin_router
from web.admin.live_sampler import start_live_sampler
from web.console import console_router
from web.ops.errors import handle_exception
from web.settings import Settings

ADMIN_TOKEN = "test-admin-token-0123456789"


def migrated_sqlite(path: Path) -> str:
    url = f"sqlite+aiosqlite:///{path}"

    async def prepare() -> None:
        db = await Database.connect(url)
        try:
            await db.upgrade()
            await ensure_admin_token(db, ADMIN_TOKEN)
        finally:
            await db.close()

    asyncio.run(prepare())
    return url


def build_admin_app(url: str, *, live_sample_s: float | None = None, **state: Any) -> Litestar:
    """The admin and console routers with the gateway's error mapping on a database at ``url``;
    with ``live_sample_s``, the live charts are sampled that often from start-up (as a gateway
    samples them)."""

    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        db = await Database.connect(url)
        app.state.db = db
        stop = None
        if live_sample_s is not None:
            stop = await start_live_sampler(app.state, live_sample_s)
        try:
            yield
        finally:
            if stop is not None:
                await stop()
            await db.close()

    settings = Settings(database_url=url, admin_token=ADMIN_TOKEN)
    return Litestar(
        route_handlers=[admin_router, console_router],
        exception_handlers={Exception: handle_exception},
        lifespan=[lifespan],
        state=State({"settings": settings, "engine": None, **state}),
        logging_config=None,
    )


@pytest.fixture
def db_url(tmp_path: Path) -> str:
    return migrated_sqlite(tmp_path / "admin.db")


@pytest.fixture
def anon(db_url: str) -> Iterator[TestClient[Litestar]]:
    """A client with no credentials."""
    with TestClient(build_admin_app(db_url)) as client:
        yield client


@pytest.fixture
def admin(db_url: str) -> Iterator[TestClient[Litestar]]:
    """A client that sends the admin token on every request."""
    with TestClient(build_admin_app(db_url)) as client:
        client.headers["Authorization"] = f"Bearer {ADMIN_TOKEN}"
        yield client


def assert_error(response: Any, status: int, code: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if code is not None:
        assert error["code"] == code
    return dict(error)


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/admin/v1/tenants"),
        ("POST", "/admin/v1/tenants"),
        ("GET", "/admin/v1/tenants/tn_x"),
        ("DELETE", "/admin/v1/keys/key_x"),
        ("GET", "/admin/v1/audit"),
        ("GET", "/admin/v1/engine"),
    ],
)
def test_routes_refuse_requests_without_a_token(
    anon: TestClient[Litestar], method: str, path: str
) -> None:
    error = assert_error(anon.request(method, path, json={}), 401)
    assert error["type"] == "authentication_error"


@pytest.mark.parametrize("header", ["Bearer wrong-token", "Bearer ", "Basic abc", ADMIN_TOKEN])
def test_a_wrong_or_malformed_token_is_refused(anon: TestClient[Litestar], header: str) -> None:
    response = anon.get("/admin/v1/tenants", headers={"Authorization": header})
    assert_error(response, 401, "invalid_admin_token")


def test_a_tenant_api_key_is_not_an_admin_token(admin: TestClient[Litestar]) -> None:
    tenant = admin.post("/admin/v1/tenants", json={"name": "acme"}).json()
    key = admin.post(f"/admin/v1/tenants/{tenant['id']}/keys", json={}).json()["key"]
    response = admin.get("/admin/v1/tenants", headers={"Authorization": f"Bearer {key}"})
    assert_error(response, 401)


def test_the_right_token_is_accepted(admin: TestClient[Litestar]) -> None:
    response = admin.get("/admin/v1/tenants")
    assert response.status_code == 200
    assert response.json() == []
