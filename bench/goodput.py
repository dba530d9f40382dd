"""Goodput: open-loop Poisson arrivals of realistic chat over a sweep of request rates.

    python -m bench.goodput [--rates 0.5 1 2 4] [--duration 60] [--with-vllm]

For each server (Atrium as ``atrium serve`` starts it; vLLM's CPU build with ``--with-vllm``,
from ``bench/.vllm-venv`` as ``make bench-compare`` installs it) and each rate, conversations of
``bench/chat_workload.py`` start at exponential gaps for ``--duration`` seconds (a follow-up turn
goes when its answer is in), and every request's TTFT and TPOT are kept. Reports per rate the
TTFT/TPOT p50/p99 and the share of requests within (TTFT 2 s, TPOT 200 ms) and (1 s, 100 ms), and
per server the highest rate at which 90% are (``bench/goodput_metrics.py``); JSON on stdout and
in ``bench/out/goodput.json``, a plot of the shares beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import torch

from bench.chat_workload import Conversation, chat_body, conversations
from bench.common import DEFAULT_OUT_DIR, emit, quiet_logging
from bench.goodput_metrics import OBJECTIVES, goodput, rate_summary
from bench.loadgen import RequestSpec, Target, client_for, run_closed_loop, stream_request
from bench.metrics import RequestRecord
from bench.plots import lines
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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--rates", type=float, nargs="+", default=[0.25, 0.5, 1.0, 2.0, 4.0], help="req/s")
    add("--duration", type=float, default=60.0, help="seconds of arrivals per rate")
    add("--drain", type=float, default=120.0, help="seconds a rate's last requests may take")
    add("--tenants", type=int, default=4)
    add("--max-tokens", type=int, default=128)
    add("--seed", type=int, default=0)
    add("--with-vllm", action="store_true", help="also vLLM's CPU build, after Atrium")
    add("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    add("--model-dir", type=Path, default=None)
    add("--vllm-python", type=Path, default=Path("bench/.vllm-venv/bin/python"))
    add("--atrium-port", type=int, default=8321)
    add("--vllm-port", type=int, default=8322)
    add("--out-dir", type=Path, default=DEFAULT_OUT_DIR)
    return parser.parse_args(argv)


async def run_open_loop(
    target: Target, items: Sequence[Conversation], rate: float, duration_s: float, drain_s: float
) -> list[RequestRecord]:
    """Start conversations at Poisson arrivals of ``rate`` a second for ``duration_s``; each
    sends its turns in order. Requests still running ``drain_s`` after the last arrival are cut
    off (recorded as errors, so they count against goodput)."""
    rng = random.Random(f"{rate}:{len(items)}")
    stop_at = time.perf_counter() + duration_s + drain_s
    arrivals_end = time.perf_counter() + duration_s

    async def converse(
        client: httpx.AsyncClient, conversation: Conversation
    ) -> list[RequestRecord]:
        records: list[RequestRecord] = []
        answers: list[str] = []
        for turn in range(len(conversation.turns)):
            texts: list[str] = []
            body = chat_body(target, conversation, answers, turn)
            path = "/v1/chat/completions"
            record = await stream_request(
                client, target, conversation.tenant, path, body, texts, stop_at
            )
            records.append(record)
            if not record.ok:
                break
            answers.append("".join(texts))
        return records

    async with client_for(duration_s + drain_s, 512) as client:
        tasks = []
        for conversation in items:
            if time.perf_counter() >= arrivals_end:
                break
            tasks.append(asyncio.create_task(converse(client, conversation)))
            await asyncio.sleep(rng.expovariate(rate))
        runs = await asyncio.gather(*tasks)
    return [record for records in runs for record in records]


def warm_up(target: Target, tenant: str) -> None:
    """One short request first: kernels built or loaded on first use are not counted."""
    spec = RequestSpec(tenant, " hello world" * 8, 4)
    records = asyncio.run(run_closed_loop(target, [spec], 1, 900))
    if not records or not records[0].ok:
        raise SystemExit(f"warm-up failed: {records[0].error if records else 'no request'}")


def sweep(target: Target, args: argparse.Namespace) -> dict[float, list[RequestRecord]]:
    """Every rate in turn on one server, each with fresh conversations (no cache carried)."""
    warm_up(target, "t0")
    out = {}
    for i, rate in enumerate(sorted(args.rates)):
        need = int(rate * args.duration * 3) + 8
        items = conversations(args.tenants, need, args.seed + i, args.max_tokens)
        out[rate] = asyncio.run(run_open_loop(target, items, rate, args.duration, args.drain))
    return out


def run_server(name: str, args: argparse.Namespace) -> dict[float, list[RequestRecord]]:
    tenants = [f"t{i}" for i in range(args.tenants)]
    server: Server | None = None
    log_dir = args.out_dir / "logs"
    with tempfile.TemporaryDirectory(prefix="atrium-goodput-") as tmp:
        if name == "atrium":
            env = atrium_env(Path(tmp))
            keys = create_tenant_keys(tenants, env)
            server = start_atrium(
                args.model_dir, args.atrium_port, Path(tmp), log_dir, args.dtype, env
            )
            wait_ready(server, "/readyz", 600)
            target = Target(server.base_url, args.model_dir.name, keys)
        else:
            server = start_vllm(
                args.vllm_python, args.model_dir, args.vllm_port, log_dir, args.dtype
            )
            wait_ready(server, "/health", 900)
            target = Target(server.base_url, "smollm2", {})
        try:
            return sweep(target, args)
        finally:
            stop(server)


def report(results: dict[str, dict[float, list[RequestRecord]]]) -> dict[str, Any]:
    """Per server: each rate's latencies and shares, and the goodput rate per objective."""
    return {
        name: {
            "rates": {str(rate): rate_summary(records) for rate, records in per_rate.items()},
            "goodput_req_s": goodput(per_rate),
        }
        for name, per_rate in results.items()
    }


def plot(summary: dict[str, Any], out_dir: Path) -> list[Path]:
    paths = []
    for objective in OBJECTIVES:
        series: dict[str, list[float]] = {}
        rates: list[float] = []
        for name, result in summary.items():
            rates = [float(r) for r in result["rates"]]
            series[name] = [v["meeting"][objective.name] for v in result["rates"].values()]
        slug = objective.name.replace("<=", "-").replace(",", "_")
        path = out_dir / f"goodput_{slug}.png"
        title = f"Share of requests within {objective.name}"
        paths.append(lines(rates, series, title, "request rate (req/s)", "share", path))
    return paths


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dtype == "auto":
        args.dtype = dtype_name(resolve_dtype("auto", torch.device("cpu")))
    quiet_logging()
    if args.model_dir is None:
        args.model_dir = export_model(DEFAULT_OUT_DIR / f"smollm2-hf-{args.dtype}", args.dtype)
    started = time.perf_counter()
    servers = ["atrium", "vllm"] if args.with_vllm else ["atrium"]
    summary = report({name: run_server(name, args) for name in servers})
    result: dict[str, Any] = {
        "dtype": args.dtype,
        "rates": sorted(args.rates),
        "duration_s": args.duration,
        "servers": summary,
        "seconds": time.perf_counter() - started,
    }
    if args.with_vllm:
        ours, theirs = summary["atrium"]["goodput_req_s"], summary["vllm"]["goodput_req_s"]
        result["atrium_over_vllm"] = {
            name: (ours[name] / theirs[name] if ours[name] and theirs[name] else None)
            for name in ours
        }
    result["plots"] = [str(p) for p in plot(summary, args.out_dir)]
    emit(result, args.out_dir, "goodput")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
