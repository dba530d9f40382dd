"""Real servers for tests: an `atrium serve` subprocess started and waited for until ready, or
an app under uvicorn on a thread of the test's process."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import uvicorn

ATRIUM = [sys.executable, "-c", "from web.cli import main; raise SystemExit(main())"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def serving_on_thread(app: Any) -> Iterator[str]:
    """``app`` (its lifespan included) under uvicorn on a thread, on a free loopback port, until
    the block ends; yields its base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(app, log_config=None, access_log=False, lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def atrium(*args: str, env: dict[str, str]) -> dict[str, object]:
    done = subprocess.run(
        [*ATRIUM, *args], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


class Server:
    def __init__(self, tmp: Path) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.env = {
            **os.environ,
            "ATRIUM_DATABASE_URL": f"sqlite+aiosqlite:///{tmp / 'atrium.db'}",
            "ATRIUM_ADMIN_TOKEN": "admin-e2e-token",
            "ATRIUM_USAGE_SPOOL_PATH": str(tmp / "usage.spool"),
            "ATRIUM_DTYPE": "float32",
            # By default the pool takes a share of free memory (GBs); these tests need little.
            "ATRIUM_KV_CACHE_BYTES": str(256 * 2**20),
        }
        self.tenant_ids: dict[str, str] = {}

    def client(self, key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base}/v1", api_key=key, max_retries=0)

    def key_for(self, tenant: str) -> str:
        if tenant not in self.tenant_ids:
            self.tenant_ids[tenant] = str(atrium("tenants", "create", tenant, env=self.env)["id"])
        return str(atrium("keys", "create", self.tenant_ids[tenant], env=self.env)["key"])

    def admin(self, method: str, path: str, body: object = None) -> httpx.Response:
        headers = {"Authorization": "Bearer admin-e2e-token"}
        return httpx.request(method, self.base + path, json=body, headers=headers, timeout=30)


@contextmanager
def running_server(tmp: Path) -> Iterator[tuple[Server, subprocess.Popen[bytes], Path]]:
    """`atrium serve` on a free port with a fresh SQLite file, once ``/readyz`` answers 200;
    on the way out its process group (the gateway and its engine process) is killed, so a test
    that failed mid-start leaves no model loading beside the tests after it."""
    srv = Server(tmp)
    log_path = tmp / "serve.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [*ATRIUM, "serve", "--port", str(srv.port)],
            env=srv.env,
            stdout=log,
            stderr=log,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            assert proc.poll() is None, log_path.read_text()
            try:
                if httpx.get(srv.base + "/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        else:
            pytest.fail("atrium serve did not become ready")
        yield srv, proc, log_path
    finally:
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
