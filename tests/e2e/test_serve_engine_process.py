"""`atrium serve` runs its engine in a child process: it stops with the gateway, and when it
dies on its own the gateway says so (`/readyz` 503, requests 503 `engine_dead`), never hangs."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.serve import Server, running_server

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def children(pid: int) -> list[int]:
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        found += [int(child) for child in text]
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


@pytest.fixture
def serving(tmp_path: Path) -> Iterator[tuple[Server, subprocess.Popen[bytes], Path]]:
    with running_server(tmp_path) as started:
        yield started


def engine_pid(proc: subprocess.Popen[bytes]) -> int:
    engines = [
        pid
        for pid in children(proc.pid)
        if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()
    ]
    assert len(engines) == 1, children(proc.pid)
    return engines[0]


def chat(srv: Server, key: str) -> httpx.Response:
    body = {"model": "default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    headers = {"Authorization": f"Bearer {key}"}
    return httpx.post(srv.base + "/v1/chat/completions", json=body, headers=headers, timeout=60)


def test_the_engine_process_stops_with_the_gateway(
    serving: tuple[Server, subprocess.Popen[bytes], Path],
) -> None:
    srv, proc, log_path = serving
    child = engine_pid(proc)
    assert chat(srv, srv.key_for("acme")).status_code == 200
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0, log_path.read_text()
    deadline = time.monotonic() + 10
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(child), "the engine process outlived the gateway"


def test_a_killed_engine_makes_the_gateway_unready_and_requests_fail_fast(
    serving: tuple[Server, subprocess.Popen[bytes], Path],
) -> None:
    srv, proc, log_path = serving
    key = srv.key_for("acme")
    assert chat(srv, key).status_code == 200
    os.kill(engine_pid(proc), signal.SIGKILL)
    deadline = time.monotonic() + 20
    ready = httpx.get(srv.base + "/readyz", timeout=5)
    while ready.status_code == 200 and time.monotonic() < deadline:
        time.sleep(0.2)
        ready = httpx.get(srv.base + "/readyz", timeout=5)
    assert ready.status_code == 503 and ready.json()["engine_running"] is False
    failed = chat(srv, key)
    assert failed.status_code == 503, failed.text
    assert failed.json()["error"]["code"] == "engine_dead"
    assert proc.poll() is None  # the gateway itself keeps answering
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0, log_path.read_text()
