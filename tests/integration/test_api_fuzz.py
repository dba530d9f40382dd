"""Fuzzing every route of the OpenAPI document (schemathesis): requests generated from the
documented bodies, parameters and headers, sent with valid credentials and without. No answer
may be a 5xx, and every error is in the documented shape.

The gateway runs under uvicorn on a thread of this process, with the scripted engine and a
SQLite tenant database; a few examples per route keep the run within about a minute.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
import uvicorn
from hypothesis import HealthCheck, Phase, settings
from litestar._openapi.plugin import OpenAPIPlugin

from engine.stats import EngineSnapshot
from tenants.schemas import Quotas
from tests.integration.gateway_fakes import make_runtime
from tests.integration.gateway_fakes import settings as gateway_settings
from tests.integration.pg_gateway import ADMIN_TOKEN, create_tenant
from tests.integration.test_admin_app import migrated_sqlite
from web.app import create_app
from web.openai.openapi_bodies import describe

pytestmark = pytest.mark.slow
EXAMPLES = 12  # per route and operation; each is sent twice (with and without credentials)
ERROR_KEYS = {"message", "type", "param", "code"}


class Server:
    """The gateway app under uvicorn on a thread, on a port of its own."""

    def __init__(self, app: Any) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.base = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        config = uvicorn.Config(app, log_config=None, access_log=False, lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=lambda: asyncio.run(self.server.serve(sockets=[self.sock])), daemon=True
        )

    def __enter__(self) -> Server:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "server not started"
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()


@pytest.fixture(scope="module")
def gateway(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, str]]:
    tmp = tmp_path_factory.mktemp("fuzz")
    url = migrated_sqlite(tmp / "atrium.db")
    quotas = Quotas(requests_per_minute=100_000, monthly_token_budget=10**9)
    (key,) = asyncio.run(create_tenant(url, tmp / "seed.spool", "fuzz", quotas, 1))
    runtime, engine = make_runtime(tiny_llama_dir)
    engine.stats = EngineSnapshot  # type: ignore[attr-defined]  # an idle engine's state
    config = gateway_settings(
        database_url=url,
        admin_token=ADMIN_TOKEN,
        usage_spool_path=str(tmp / "usage.spool"),
        auth_failures_per_minute=0,  # the unauthenticated half would be rate-limited
    )
    with Server(create_app(config, engine=runtime)) as server:
        yield server.base, key


def _document() -> dict[str, Any]:
    """The document ``/schema/openapi.json`` serves, built without starting the app."""
    app = create_app(gateway_settings())
    describe(app)
    return dict(app.plugins.get(OpenAPIPlugin).provide_openapi_schema())


schema = schemathesis.openapi.from_dict(_document())


def _check(response: Any, where: str) -> None:
    assert response.status_code < 500, f"{where}: {response.status_code} {response.text[:300]}"
    kind = response.headers.get("content-type", [""])  # each header: a list of its values
    kind = kind[0] if isinstance(kind, list) else kind
    if response.status_code >= 400 and kind.startswith("application/json"):
        error = response.json().get("error")
        assert isinstance(error, dict) and set(error) == ERROR_KEYS, f"{where}: {response.text}"


@schema.parametrize()
@settings(
    max_examples=EXAMPLES,
    deadline=None,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=list(HealthCheck),
    database=None,
)
def test_no_route_answers_a_5xx_with_or_without_credentials(
    case: Any, gateway: tuple[str, str]
) -> None:
    base, key = gateway
    token = ADMIN_TOKEN if case.path.startswith("/admin/") else key
    where = f"{case.method} {case.formatted_path}"
    _check(case.call(base_url=base, headers={"Authorization": f"Bearer {token}"}), where)
    anonymous = case.call(base_url=base, headers={"Authorization": "Bearer not-a-key"})
    _check(anonymous, where + " (no credentials)")
    if case.method != "OPTIONS" and case.path not in ("/healthz", "/readyz", "/metrics"):
        assert anonymous.status_code in (400, 401, 404, 405, 413), where


def test_the_document_describes_every_route_and_body() -> None:
    doc = _document()
    paths = doc["paths"]
    assert len(paths) >= 20
    for path in ("/v1/chat/completions", "/v1/completions", "/admin/v1/tenants"):
        body = paths[path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        name = body["$ref"].rsplit("/", 1)[1]
        assert doc["components"]["schemas"][name]["properties"], path
    chat = doc["components"]["schemas"]["ChatCompletionRequest"]
    assert {"model", "messages", "max_tokens", "stream"} <= set(chat["properties"])
    answers = paths["/v1/chat/completions"]["post"]["responses"]
    assert set(answers["200"]["content"]) == {"application/json", "text/event-stream"}
    assert answers["429"]["content"]["application/json"]["schema"]["$ref"].endswith("ErrorBody")
    for path, operations in paths.items():
        for method, operation in operations.items():
            bodiless = path.endswith(("/rotate", "/keys", "/cancel"))
            if method in ("post", "put", "patch") and not bodiless:
                assert "requestBody" in operation, f"{method} {path}"
