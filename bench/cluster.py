"""Atrium's three roles on loopback: engine servers, the smg router in front, gateways behind.

Used by the cluster test and ``bench.scale_out``. Everything binds 127.0.0.1; the router gets
no tokenizer to load (it matches prefixes on text) and is told never to look for a model hub.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from bench.servers import HOST, Server, _spawn, stop, wait_ready

ROUTER_BINARY = "smg"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def router_binary() -> str | None:
    """The smg launcher next to this interpreter, or on PATH; None when it is not installed."""
    beside = Path(sys.executable).parent / ROUTER_BINARY
    return str(beside) if beside.is_file() else shutil.which(ROUTER_BINARY)


def _atrium(*args: str) -> list[str]:
    return [sys.executable, "-m", "web.cli", "serve", "--host", HOST, *args]


def start_engine(
    model: str,
    port: int,
    token: str,
    log_dir: Path,
    env: dict[str, str] | None = None,
    gateway_url: str | None = None,
) -> Server:
    """`atrium serve --role engine` on ``port`` (following ``gateway_url``'s public prefixes
    when given); ready once /health answers 200."""
    environ = {**os.environ, **(env or {}), "ATRIUM_ENGINE_TOKEN": token}
    argv = _atrium("--role", "engine", "--port", str(port), "--model", model)
    if gateway_url is not None:
        argv += ["--gateway-url", gateway_url]
    return _spawn(f"engine-{port}", argv, environ, log_dir / f"engine-{port}.log",
                  f"http://{HOST}:{port}")  # fmt: skip


def start_gateway(
    model: str, port: int, engine_url: str, token: str, env: dict[str, str], log_dir: Path
) -> Server:
    """`atrium serve --role gateway` on ``port`` sending generation to ``engine_url``."""
    environ = {**os.environ, **env, "ATRIUM_ENGINE_TOKEN": token}
    argv = _atrium("--role", "gateway", "--engine-url", engine_url, "--port", str(port))
    argv += ["--model", model]
    return _spawn(f"gateway-{port}", argv, environ, log_dir / f"gateway-{port}.log",
                  f"http://{HOST}:{port}")  # fmt: skip


def start_router(
    worker_urls: list[str],
    port: int,
    metrics_port: int,
    token: str,
    log_dir: Path,
    policy: str = "cache_aware",
    extra: tuple[str, ...] = (),
) -> Server:
    """smg in front of ``worker_urls``; it checks the engine token from its callers and sends
    it to the engines (``--api-key``). Health checks every second, so a dead engine leaves the
    rotation within a few seconds (retries cover the requests in between)."""
    binary = router_binary()
    if binary is None:
        raise FileNotFoundError("the smg router is not installed (pip install smg)")
    argv = [binary, "launch", "--host", HOST, "--port", str(port), "--policy", policy]
    argv += ["--worker-urls", *worker_urls, "--api-key", token]
    argv += ["--prometheus-host", HOST, "--prometheus-port", str(metrics_port)]
    argv += ["--disable-tokenizer-autoload", "--log-level", "warn"]
    argv += ["--health-check-interval-secs", "1", "--health-failure-threshold", "1"]
    argv += ["--worker-startup-check-interval", "1", "--shutdown-grace-period-secs", "2", *extra]
    environ = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return _spawn(f"router-{port}", argv, environ, log_dir / f"router-{port}.log",
                  f"http://{HOST}:{port}")  # fmt: skip


def wait_workers(router: Server, token: str, count: int, timeout_s: float = 60.0) -> None:
    """Wait until the router lists ``count`` healthy workers."""
    deadline = time.monotonic() + timeout_s
    headers = {"Authorization": f"Bearer {token}"}
    while time.monotonic() < deadline:
        if router.process.poll() is not None:
            raise RuntimeError(f"{router.name} exited early; see {router.log_path}")
        try:
            answer = httpx.get(f"{router.base_url}/workers", headers=headers, timeout=2.0)
            workers = answer.json().get("workers", []) if answer.status_code == 200 else []
            if sum(1 for w in workers if w.get("is_healthy")) >= count:
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{router.name}: fewer than {count} healthy workers; see {router.log_path}")


def wait_all(servers: list[Server], path: str, timeout_s: float = 180.0) -> None:
    for server in servers:
        wait_ready(server, path, timeout_s)


def stop_all(servers: list[Server], grace_s: float = 10.0) -> None:
    """SIGINT every server at once, then wait for each (SIGKILL after ``grace_s``)."""
    for server in servers:
        if server.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(os.getpgid(server.process.pid), signal.SIGINT)
    deadline = time.monotonic() + grace_s
    for server in servers:
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.process.wait(max(deadline - time.monotonic(), 0.1))
        stop(server, grace_s=1.0)
