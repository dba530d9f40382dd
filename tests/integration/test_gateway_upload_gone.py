"""A client that leaves while its request body is still arriving is a 499 ("client closed
request") logged at info level: anyone can do it at will, so it is never an error-level
`unhandled_exception` 500."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from tenants.schemas import Quotas
from tests.integration.gateway_fakes import MODEL, make_runtime, settings
from tests.integration.pg_gateway import create_tenant
from tests.support.postgres import migrate
from web.app import create_app

UPLOADS = {
    "/v1/completions": (
        "application/json",
        b'{"model": "' + MODEL.encode() + b'", "prompt": "a long prompt, ',
    ),
    "/v1/chat/completions": ("application/json", b'{"model": "x", "messages": [{"role": '),
}


async def _upload_then_leave(
    app: Any, key: str, path: str, content_type: str, part: bytes
) -> list[int]:
    """Send the first part of a body (announced as longer), then disconnect; the statuses the
    app tried to answer with."""
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": part, "more_body": True}
        await asyncio.sleep(0.05)  # a slow client, then gone
        return {"type": "http.disconnect"}

    statuses: list[int] = []

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            statuses.append(message["status"])

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"authorization", f"Bearer {key}".encode()),
            (b"content-type", content_type.encode()),
            (b"content-length", b"100000"),
        ],
        "client": ("127.0.0.1", 1234),
        "server": ("127.0.0.1", 8000),
        "state": {},
    }
    async with app.lifespan():
        await app(scope, receive, send)
    return statuses


@pytest.mark.parametrize("path", sorted(UPLOADS))
def test_a_client_gone_mid_upload_is_a_499_at_info_level(
    tiny_llama_dir: Path, tmp_path: Path, path: str
) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'atrium.db'}"
    asyncio.run(migrate(url))
    (key,) = asyncio.run(create_tenant(url, tmp_path / "seed.spool", "acme", Quotas(), 1))
    runtime, engine = make_runtime(tiny_llama_dir)
    config = settings(database_url=url, usage_spool_path=str(tmp_path / "usage.spool"))
    app = create_app(config, engine=runtime, include_admin=False)
    content_type, part = UPLOADS[path]
    with capture_logs() as logs:
        statuses = asyncio.run(_upload_then_leave(app, key, path, content_type, part))
    assert statuses == [499]
    assert [e for e in logs if e["log_level"] in ("error", "critical")] == []
    closed = [e for e in logs if e["event"] == "client_closed_request"]
    assert [(e["log_level"], e["path"]) for e in closed] == [("info", path)]
    assert engine.requests == []  # nothing was computed for it
