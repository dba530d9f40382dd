"""Start and stop the compared servers on 127.0.0.1: `atrium serve` and vLLM's CPU build.

Each server runs in its own process group with its log in a file; readiness is polled over HTTP.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

HOST = "127.0.0.1"
MAX_NUM_SEQS = 32  # the same running-batch cap on both servers (PEERS.md's vLLM setting)
KV_CACHE_GIB = 4  # the same KV budget on both servers (vLLM's VLLM_CPU_KVCACHE_SPACE)


@dataclass(slots=True)
class Server:
    name: str
    base_url: str
    process: subprocess.Popen[bytes]
    log_path: Path


def atrium_cli(*args: str, env: dict[str, str] | None = None) -> str:
    """Run ``atrium ARGS`` with this interpreter and return its stdout (raises on failure)."""
    done = subprocess.run(
        [sys.executable, "-m", "web.cli", *args],
        capture_output=True,
        check=True,
        text=True,
        env=env,
        timeout=300,
    )
    return done.stdout


def export_model(out_dir: Path, dtype: str = "bfloat16") -> Path:
    """The default model as a Hugging Face directory in ``dtype`` (kept between runs). In
    float32 these are the GGUF file's weights exactly as decoded; in bfloat16 rounded once."""
    if not (out_dir / "config.json").is_file():
        atrium_cli("model", "export", str(out_dir), "--dtype", dtype)
    return out_dir


def _spawn(name: str, argv: list[str], env: dict[str, str], log_path: Path, url: str) -> Server:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    return Server(name, url, process, log_path)


def wait_ready(server: Server, path: str, timeout_s: float) -> float:
    """Poll ``path`` until it answers 200; returns seconds waited. Raises if the process dies."""
    start = time.perf_counter()
    while time.perf_counter() - start < timeout_s:
        if server.process.poll() is not None:
            raise RuntimeError(f"{server.name} exited early; see {server.log_path}")
        try:
            if httpx.get(server.base_url + path, timeout=2.0, trust_env=False).status_code == 200:
                return time.perf_counter() - start
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    stop(server)
    raise TimeoutError(f"{server.name} not ready after {timeout_s:.0f}s; see {server.log_path}")


def stop(server: Server, grace_s: float = 30.0) -> None:
    """SIGINT its process group, then SIGKILL after ``grace_s``."""
    if server.process.poll() is not None:
        return
    pgid = os.getpgid(server.process.pid)
    os.killpg(pgid, signal.SIGINT)
    try:
        server.process.wait(grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(pgid, signal.SIGKILL)
        server.process.wait(10)


def atrium_env(work_dir: Path) -> dict[str, str]:
    return {
        **os.environ,
        "ATRIUM_DATABASE_URL": f"sqlite+aiosqlite:///{work_dir / 'atrium.db'}",
        "ATRIUM_USAGE_SPOOL_PATH": str(work_dir / "usage.spool"),
        "ATRIUM_ADMIN_TOKEN": "bench-admin-token-not-secret",
        "ATRIUM_LOG_LEVEL": "warning",
        "ATRIUM_MAX_NUM_SEQS": str(MAX_NUM_SEQS),
        "ATRIUM_KV_CACHE_BYTES": str(KV_CACHE_GIB * 2**30),
    }


def create_tenant_keys(tenants: list[str], env: dict[str, str]) -> dict[str, str]:
    """A tenant and a key for each name, through the CLI; returns name -> key."""
    keys = {}
    for name in tenants:
        tenant = json.loads(atrium_cli("tenants", "create", name, env=env))
        keys[name] = json.loads(atrium_cli("keys", "create", tenant["id"], env=env))["key"]
    return keys


def start_atrium(
    model_dir: Path,
    port: int,
    work_dir: Path,
    log_dir: Path,
    dtype: str = "bfloat16",
    env: dict[str, str] | None = None,
) -> Server:
    """`atrium serve` on ``model_dir``; ``env`` replaces ``atrium_env(work_dir)`` when given."""
    env = atrium_env(work_dir) if env is None else env
    argv = [sys.executable, "-m", "web.cli", "serve", "--host", HOST, "--port", str(port)]
    argv += ["--model", str(model_dir), "--dtype", dtype]
    return _spawn("atrium", argv, env, log_dir / "atrium.log", f"http://{HOST}:{port}")


def start_vllm(
    python: Path, model_dir: Path, port: int, log_dir: Path, dtype: str = "bfloat16"
) -> Server:
    """vLLM's OpenAI server bound to both cores, prefix caching and chunked prefill on."""
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GIB),
        "VLLM_CPU_OMP_THREADS_BIND": "0-1",
    }
    argv = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir)]
    argv += ["--served-model-name", "smollm2", "--host", HOST, "--port", str(port)]
    argv += ["--dtype", dtype, "--max-model-len", "8192", "--max-num-seqs", str(MAX_NUM_SEQS)]
    argv += ["--enable-prefix-caching", "--enable-chunked-prefill"]
    argv += ["--enable-prompt-tokens-details"]  # cached_tokens in usage, as Atrium reports
    return _spawn("vllm", argv, env, log_dir / "vllm.log", f"http://{HOST}:{port}")
