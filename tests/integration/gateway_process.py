"""A gateway in a process of its own (the crash worker: the scripted engine, slow tokens), for
tests that kill one or run another release's code: ready once ``/readyz`` answers 200."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import httpx

from tests.integration.pg_gateway import ADMIN_TOKEN
from tests.support.serve import free_port

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path("tests/integration/faults/crash_gateway_worker.py")


@contextmanager
def started_gateway(
    model: Path,
    url: str,
    tmp: Path,
    name: str,
    *,
    env: Mapping[str, str] | None = None,
    root: Path = ROOT,
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """The gateway of the code tree ``root`` on the database ``url``, serving the tokenizer
    of ``model``; stopped (SIGINT, then SIGKILL) on the way out. Yields its base URL and
    process."""
    port = free_port()
    environ = {
        **os.environ,
        "PYTHONPATH": str(root),
        "ATRIUM_DATABASE_URL": url,
        "ATRIUM_ADMIN_TOKEN": ADMIN_TOKEN,
        "ATRIUM_USAGE_SPOOL_PATH": str(tmp / f"{name}.spool"),
        "ATRIUM_DRAIN_GRACE_S": "1",
        **(env or {}),
    }
    log_path = tmp / f"{name}.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, str(root / WORKER), str(model), str(port)],
            env=environ,
            stdout=log,
            stderr=log,
            cwd=tmp,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60  # start-up alone takes 15 s on a busy 2-core box
        while True:
            assert proc.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, "gateway not ready:\n" + log_path.read_text()
            try:
                if httpx.get(base + "/readyz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        yield base, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
