"""One compared server at a time over HTTP: the flags the comparisons share, the model both
servers run, and a server started, warmed up and stopped around a measurement.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench.common import DEFAULT_OUT_DIR
from bench.loadgen import RequestSpec, Target, run_closed_loop
from bench.servers import (
    Server,
    atrium_env,
    create_tenant_keys,
    export_model,
    start_atrium,
    start_vllm,
    stop,
    wait_ready,
)
from engine.device import dtype_name, resolve_dtype

SERVER_NAMES = ("atrium", "vllm", "atrium-nodrafts")  # the last: Atrium with n-gram drafts off


@dataclass(frozen=True, slots=True)
class Served:
    target: Target
    startup_s: float  # from the start of the process to its first ready answer


def add_server_args(
    parser: argparse.ArgumentParser, atrium_port: int = 8311, vllm_port: int = 8312
) -> None:
    """``--servers``, ``--dtype``, ``--model-dir``, ``--vllm-python``, the ports, ``--out-dir``."""
    add = parser.add_argument
    add("--servers", nargs="+", default=["atrium", "vllm"], choices=SERVER_NAMES)
    add(
        "--dtype",
        default="auto",
        choices=["auto", "bfloat16", "float32"],
        help="both servers'; auto: what `atrium serve` picks on this machine",
    )
    add(
        "--model-dir",
        type=Path,
        default=None,
        help="a Hugging Face export both serve (default: the default model exported in --dtype, "
        "bench/out/smollm2-hf-DTYPE)",
    )
    add("--vllm-python", type=Path, default=Path("bench/.vllm-venv/bin/python"))
    add("--atrium-port", type=int, default=atrium_port)
    add("--vllm-port", type=int, default=vllm_port)
    add("--out-dir", type=Path, default=DEFAULT_OUT_DIR)


def resolve_model(args: argparse.Namespace) -> None:
    """Settle ``args.dtype`` (auto: what `atrium serve` picks here) and ``args.model_dir`` (the
    default model exported in that dtype unless one was given)."""
    if args.dtype == "auto":
        args.dtype = dtype_name(resolve_dtype("auto", torch.device("cpu")))
    if args.model_dir is None:
        args.model_dir = export_model(DEFAULT_OUT_DIR / f"smollm2-hf-{args.dtype}", args.dtype)


@contextmanager
def serving(
    name: str, args: argparse.Namespace, tenants: Sequence[str], extra_body: dict[str, Any]
) -> Iterator[Served]:
    """Start server ``name`` with the flags of ``add_server_args`` (Atrium on a temporary
    database with a key per tenant; vLLM without keys), wait until it is ready, send one warm-up
    request, yield it, and stop it however the block ends."""
    server: Server | None = None
    with tempfile.TemporaryDirectory(prefix="atrium-bench-") as tmp:
        log_dir = args.out_dir / "logs"
        started = time.perf_counter()
        if name.startswith("atrium"):
            env = atrium_env(Path(tmp))
            if name == "atrium-nodrafts":
                env["ATRIUM_SPECULATIVE_TOKENS"] = "0"
            keys = create_tenant_keys(list(tenants), env)
            server = start_atrium(
                args.model_dir, args.atrium_port, Path(tmp), log_dir, args.dtype, env
            )
            wait_ready(server, "/readyz", 600)
            target = Target(server.base_url, args.model_dir.name, keys, extra_body)
        else:
            server = start_vllm(
                args.vllm_python, args.model_dir, args.vllm_port, log_dir, args.dtype
            )
            wait_ready(server, "/health", 900)
            target = Target(server.base_url, "smollm2", {}, extra_body)
        startup_s = time.perf_counter() - started
        try:
            warm_up = [RequestSpec(tenants[0], " hello world" * 8, 4)]
            asyncio.run(run_closed_loop(target, warm_up, 1, 300))
            yield Served(target, startup_s)
        finally:
            stop(server)
