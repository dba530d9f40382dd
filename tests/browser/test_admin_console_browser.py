"""The console in Chromium: sign in, tenants, keys, usage, billing export, revocation, audit."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import httpx
import openai
import pytest
import uvicorn

from engine.stats import EngineSnapshot
from tenants.auth_cache import AuthCache
from tenants.database import Database
from tenants.errors import InvalidKeyError
from tenants.key_service import KeyService
from tenants.records import UsageEvent
from tenants.server_secrets import load_key_secret
from tenants.usage_store import UsageStore
from tests.browser.console_flow import ADMIN_TOKEN, Usage, walk_the_console
from tests.integration.test_admin_app import build_admin_app, migrated_sqlite

pytestmark = [pytest.mark.browser, pytest.mark.slow]
T = TypeVar("T")
RECORDED = Usage(prompt_tokens=1234, cached_tokens=200, completion_tokens=56)


def in_thread(work: Callable[[], T]) -> T:
    """Run ``work`` on a fresh thread: Playwright's sync API keeps an event loop on this one."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(work).result()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RecordingGateway:
    """The admin app under uvicorn; a "completion" authenticates the key and meters one event."""

    def __init__(self, url: str, port: int) -> None:
        self.url = url
        self.base_url = f"http://127.0.0.1:{port}"
        self.calls = 0

    def model(self, key: str) -> str:
        return "tiny-model"

    def complete(self, key: str) -> int | Usage:
        async def run() -> int | Usage:
            db = await Database.connect(self.url)
            try:
                keys = KeyService(db, await load_key_secret(db), AuthCache(ttl_s=0.0))
                try:
                    ctx = await keys.authenticate(key)
                except InvalidKeyError:
                    return 401
                self.calls += 1
                now = datetime.now(UTC)
                await UsageStore(db).write(
                    [
                        UsageEvent(
                            request_id=f"req-{self.calls}",
                            tenant_id=ctx.tenant_id,
                            key_id=ctx.key_id,
                            model="tiny-model",
                            prompt_tokens=RECORDED.prompt_tokens,
                            cached_tokens=RECORDED.cached_tokens,
                            completion_tokens=RECORDED.completion_tokens,
                            status="ok",
                            started_at=now,
                            finished_at=now,
                        )
                    ]
                )
                return RECORDED
            finally:
                await db.close()

        return in_thread(lambda: asyncio.run(run()))


class IdleEngine:
    def stats(self) -> EngineSnapshot:
        return EngineSnapshot(num_pages_total=64, num_pages_free=64)


@pytest.fixture
def recording_gateway(tmp_path: Path) -> Iterator[RecordingGateway]:
    url = in_thread(lambda: migrated_sqlite(tmp_path / "console.db"))
    port = free_port()
    app = build_admin_app(url, engine=IdleEngine())
    # The fixture's token must match the flow's: store it over the default one.
    from tenants.server_secrets import ensure_admin_token

    async def store_token() -> None:
        db = await Database.connect(url)
        try:
            await ensure_admin_token(db, ADMIN_TOKEN)
        finally:
            await db.close()

    in_thread(lambda: asyncio.run(store_token()))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the admin app did not start"
        time.sleep(0.05)
    yield RecordingGateway(url, port)
    server.should_exit = True
    thread.join(timeout=10)


def test_console_walkthrough(
    page: Any, recording_gateway: RecordingGateway, artifacts: Path
) -> None:
    assert walk_the_console(page, recording_gateway, artifacts) == RECORDED
    assert recording_gateway.calls == 1


class ServedGateway:
    """A real `atrium serve` process on a tiny model; completions through the `openai` client."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url

    def client(self, key: str) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.base_url}/v1", api_key=key, max_retries=0, timeout=120
        )

    def model(self, key: str) -> str:
        with self.client(key) as client:
            return client.models.list().data[0].id

    def complete(self, key: str) -> int | Usage:
        with self.client(key) as client:
            try:
                reply = client.chat.completions.create(
                    model=self.model(key),
                    max_tokens=8,
                    messages=[{"role": "user", "content": "Hello there"}],
                )
            except openai.APIStatusError as error:
                return error.status_code
        assert reply.usage is not None
        details = reply.usage.prompt_tokens_details
        return Usage(
            prompt_tokens=reply.usage.prompt_tokens,
            cached_tokens=(details.cached_tokens or 0) if details is not None else 0,
            completion_tokens=reply.usage.completion_tokens,
        )


@pytest.fixture
def served_gateway(tmp_path: Path, tiny_llama_dir: Path) -> Iterator[ServedGateway]:
    port = free_port()
    env = os.environ | {
        "ATRIUM_ADMIN_TOKEN": ADMIN_TOKEN,
        "ATRIUM_DATABASE_URL": f"sqlite+aiosqlite:///{tmp_path / 'serve.db'}",
    }
    log = (tmp_path / "serve.log").open("w")
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "web.cli",
            "serve",
            "--port",
            str(port),
            "--model",
            str(tiny_llama_dir),
            "--dtype",
            "float32",
            "--device",
            "cpu",
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, (tmp_path / "serve.log").read_text()
            try:
                if httpx.get(f"{base_url}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, (tmp_path / "serve.log").read_text()
            time.sleep(0.5)
        yield ServedGateway(base_url)
    finally:
        process.terminate()
        process.wait(timeout=30)
        log.close()


def test_console_with_a_served_model(
    page: Any, served_gateway: ServedGateway, artifacts: Path
) -> None:
    walk_the_console(page, served_gateway, artifacts)
    watch_a_completion_live(page, served_gateway, artifacts)


def watch_a_completion_live(page: Any, gateway: ServedGateway, folder: Path) -> None:
    """The live page of a real server: a completion made while it is open shows as tokens/s,
    time to first token and inter-token latency."""
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    api = f"{gateway.base_url}/admin/v1"
    tenant = httpx.post(f"{api}/tenants", json={"name": "live"}, headers=admin).json()
    key = httpx.post(f"{api}/tenants/{tenant['id']}/keys", json={}, headers=admin).json()["key"]
    page.goto(f"{gateway.base_url}/admin/")  # the walk signed out
    page.fill('input[name="token"]', ADMIN_TOKEN)
    page.click('button[type="submit"]')
    page.wait_for_selector("nav a.active")
    page.goto(f"{gateway.base_url}/admin/live")
    page.wait_for_selector("#live-tokens[data-state]")
    assert page.get_attribute("#live-ttft", "data-state") != "missing"
    assert isinstance(gateway.complete(key), Usage)
    for chart in ("tokens", "ttft", "itl"):
        page.wait_for_selector(f'#live-{chart}[data-state="data"]', timeout=15_000)
    points = int(page.get_attribute("body", "data-live-points"))
    page.wait_for_function(f"Number(document.body.dataset.livePoints) > {points}")
    page.screenshot(path=str(folder / "10-live.png"), full_page=True)
