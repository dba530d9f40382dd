"""Start-up progress through the real `atrium` entry point with a tiny model: JSON events on a
stderr that is not a terminal (every stage with a total, never silent for long), then `serve`'s
line saying where requests and the console go."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from tests.support.serve import ATRIUM, free_port
from web.cli import main


def _events(text: str) -> list[dict[str, Any]]:
    events = []
    for line in text.splitlines():
        if line.startswith("{"):
            events.append(json.loads(line))
    return events


MAX_SILENCE_S = 2.0  # the longest a start-up may go without a line


def _stages(events: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each stage's finished event, checked against its started one: it had a total and
    reached it."""
    started = [e["stage"] for e in events if e["event"] == "load_stage_started"]
    finished = {e["stage"]: e for e in events if e["event"] == "load_stage_finished"}
    assert started == list(finished), (started, list(finished))
    for stage in finished.values():
        assert stage["total"] is not None and stage["done"] == stage["total"], stage
    return finished


def _longest_silence_s(events: list[dict[str, Any]]) -> float:
    """The longest time between two lines from the first stage's start to the last's end."""
    load = [e for e in events if e["event"].startswith("load_")]
    times = [datetime.fromisoformat(e["timestamp"]).timestamp() for e in load]
    return max((b - a for a, b in itertools.pairwise(times)), default=0.0)


def test_generate_logs_load_stages_and_prints_only_the_text(
    tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["generate", "--prompt", "hi", "--model", str(tiny_llama_dir), "--max-tokens", "3"]
    assert main([*argv, "--dtype", "float32"]) == 0  # the `atrium` entry point, in-process
    done = capsys.readouterr()
    assert "load_" not in done.out and done.out.endswith("\n")  # stdout: the completion alone
    events = _events(done.err)
    stages = _stages(events)
    assert _longest_silence_s(events) <= MAX_SILENCE_S
    weights = stages["read weights"]
    size = sum(f.stat().st_size for f in tiny_llama_dir.glob("*.safetensors"))
    assert (weights["unit"], weights["total"]) == ("bytes", size)
    assert weights["done"] == size and weights["elapsed_s"] >= 0


def test_serve_reports_load_stages_then_where_to_send_requests(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    port = free_port()
    env = {
        **os.environ,
        "ATRIUM_ADMIN_TOKEN": "progress-admin-token-0123456789",
        "ATRIUM_USAGE_SPOOL_PATH": str(tmp_path / "usage.spool"),
        "ATRIUM_DATABASE_URL": f"sqlite+aiosqlite:///{tmp_path / 'atrium.db'}",
        "ATRIUM_KV_CACHE_BYTES": str(8 * 2**20),
    }
    args = ["serve", "--port", str(port), "--model", str(tiny_llama_dir), "--dtype", "float32"]
    log_path = tmp_path / "serve.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen([*ATRIUM, *args], env=env, stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 120
        while '"serve_ready"' not in log_path.read_text():
            assert proc.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    events = _events(log_path.read_text())
    names = [e["event"] for e in events]
    ready = events[names.index("serve_ready")]
    assert ready["api_url"] == f"http://127.0.0.1:{port}/v1"
    assert ready["console_url"] == f"http://127.0.0.1:{port}/admin/"
    # The engine process loaded the weights (and timed its steps) before the server was ready.
    stages = _stages(events[: names.index("serve_ready")])
    assert list(stages)[-4:] == ["read weights", "pack weights", "allocate KV cache", "warm up"]
    assert stages["read weights"]["unit"] == "bytes"
    assert stages["allocate KV cache"]["total"] == 8 * 2**20  # ATRIUM_KV_CACHE_BYTES
    assert stages["warm up"]["unit"] == "steps" and stages["warm up"]["elapsed_s"] >= 0
    assert _longest_silence_s(events) <= MAX_SILENCE_S
