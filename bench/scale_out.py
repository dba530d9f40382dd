"""Scale-out: the multi-tenant shared-prefix workload on one engine, then on two engines behind
the smg router with each routing policy, all through one gateway on loopback.

Prints JSON (prefix hit rate, output tok/s, TTFT p50/p99, per-engine load) and draws a plot.
On a machine with few cores the engines share them, so throughput does not scale here; what the
comparison shows is how much prefix reuse each policy keeps, and how it spreads the load.

    python -m bench.scale_out [--model DIR] [--policies round_robin cache_aware ...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx

from bench.cluster import (
    free_port,
    router_binary,
    start_engine,
    start_gateway,
    start_router,
    stop_all,
    wait_workers,
)
from bench.common import DEFAULT_OUT_DIR, emit, quiet_logging, ratio
from bench.loadgen import RequestSpec, Target, run_closed_loop, send
from bench.metrics import latency_summary
from bench.plots import bar_compare
from bench.servers import Server, atrium_env, create_tenant_keys, export_model, wait_ready
from bench.text_workloads import TextShape, shared_prefix_specs, word_vocab

TOKEN = "bench-engine-token-not-secret"
POLICIES = ("round_robin", "cache_aware", "consistent_hashing", "prefix_hash")
FALLBACK_WORDS = [f" {a}{b}{c}" for a in "bcdfg" for b in "aeiou" for c in "lmnrst"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--model", type=Path, default=None, help="HF model dir (default: SmolLM2 exported)")
    add("--dtype", default="bfloat16")
    add("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    add("--tenants", type=int, default=4)
    add("--groups", type=int, default=2, help="system prompts per tenant")
    add("--prompts", type=int, default=8, help="questions per system prompt")
    add("--system-len", type=int, default=512)
    add("--question-len", type=int, default=64)
    add("--output-len", type=int, default=32)
    add("--concurrency", type=int, default=8)
    add("--seed", type=int, default=0, help="the order of arrivals")
    add("--kv-cache-mib", type=int, default=512, help="KV cache per engine")
    add("--out-dir", type=Path, default=DEFAULT_OUT_DIR)
    return parser.parse_args(argv)


def _engine_state(engine: Server) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {TOKEN}"}
    state: dict[str, Any] = httpx.get(
        f"{engine.base_url}/atrium/v1/state", headers=headers, timeout=10
    ).json()
    return state


def _engine_load(engine: Server, before: dict[str, Any]) -> dict[str, Any]:
    """What ``engine`` did since ``before`` (its counters then)."""
    now = _engine_state(engine)["counters"]
    delta = {k: now[k] - before.get(k, 0) for k in now if isinstance(now[k], int | float)}
    prompt = delta["num_prefill_tokens"] + delta["num_cached_tokens"]
    return {
        "url": engine.base_url,
        "requests": delta["num_finished"],
        "generated_tokens": delta["num_generated_tokens"],
        "prompt_tokens": prompt,
        "hit_rate": ratio(delta["num_cached_tokens"], prompt),
    }


def run_config(
    args: argparse.Namespace, tmp: Path, specs: list[RequestSpec], engines: int, policy: str | None
) -> dict[str, Any]:
    """One configuration from cold caches: engines, the router (with two or more), a gateway."""
    name = "one engine" if policy is None else f"{engines} engines, {policy}"
    work = Path(tempfile.mkdtemp(dir=tmp))
    env = {**atrium_env(work), "ATRIUM_KV_CACHE_BYTES": str(args.kv_cache_mib * 2**20),
           "ATRIUM_DTYPE": args.dtype, "ATRIUM_LOG_LEVEL": "warning"}  # fmt: skip
    # Engines sharing one machine split its cores: two engines each spinning as many threads as
    # there are cores oversubscribe them and run 10-20x slower than one engine alone.
    threads = str(max(1, (os.cpu_count() or 1) // engines))
    engine_env = {**env, "ATRIUM_TORCH_THREADS": threads}
    servers: list[Server] = []
    try:
        pool = [
            start_engine(str(args.model), free_port(), TOKEN, work, engine_env)
            for _ in range(engines)
        ]
        servers += pool
        for engine in pool:
            wait_ready(engine, "/health", 300)
        url = pool[0].base_url
        if policy is not None:
            router = start_router([e.base_url for e in pool], free_port(), free_port(), TOKEN,
                                  work, policy=policy)  # fmt: skip
            servers.append(router)
            wait_workers(router, TOKEN, engines)
            url = router.base_url
        keys = create_tenant_keys(sorted({s.tenant for s in specs}), env)
        gateway = start_gateway(str(args.model), free_port(), url, TOKEN, env, work)
        servers.append(gateway)
        wait_ready(gateway, "/readyz", 120)
        model = httpx.get(
            f"{gateway.base_url}/v1/models",
            timeout=10,
            headers={"Authorization": f"Bearer {next(iter(keys.values()))}"},
        )
        target = Target(gateway.base_url, model.json()["data"][0]["id"], keys)
        warm = RequestSpec(specs[0].tenant, "warm up", 4)

        async def warm_up() -> None:
            async with httpx.AsyncClient(timeout=120) as client:
                await send(client, target, warm)

        asyncio.run(warm_up())
        before = {e.base_url: _engine_state(e)["counters"] for e in pool}
        records = asyncio.run(run_closed_loop(target, specs, args.concurrency))
        summary = latency_summary(records)
        loads = [_engine_load(e, before[e.base_url]) for e in pool]
    finally:
        stop_all(servers, grace_s=20)
    return {
        "name": name,
        "engines": engines,
        "policy": policy,
        "hit_rate": summary["cached_fraction"],
        "output_tok_s": summary["output_tok_s"],
        "ttft_p50_s": summary["ttft_s"]["p50"],  # type: ignore[index]
        "ttft_p99_s": summary["ttft_s"]["p99"],  # type: ignore[index]
        "num_errors": summary["num_errors"],
        "errors": summary["errors"],
        "per_engine": loads,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    quiet_logging()
    if router_binary() is None:
        raise SystemExit("the smg router is not installed: pip install smg==1.13.0")
    if args.model is None:
        args.model = export_model(DEFAULT_OUT_DIR / f"smollm2-hf-{args.dtype}", args.dtype)
    try:
        words = word_vocab(args.model / "tokenizer.json")
    except (ValueError, OSError, KeyError, json.JSONDecodeError):
        words = FALLBACK_WORDS  # a toy tokenizer: any fixed words will do
    shape = TextShape(args.tenants, args.groups, args.prompts, args.system_len,
                      args.question_len, args.output_len)  # fmt: skip
    specs = shared_prefix_specs(words, shape)
    # Arrivals in no fixed rotation: interleaved in order, round robin would place every
    # system prompt on the same engine each time by the period of the interleaving alone.
    random.Random(args.seed).shuffle(specs)
    runs = []
    with tempfile.TemporaryDirectory(prefix="atrium-scale-out-") as tmp:
        runs.append(run_config(args, Path(tmp), specs, 1, None))
        for policy in args.policies:
            runs.append(run_config(args, Path(tmp), specs, 2, policy))
    one = runs[0]["hit_rate"]
    for run in runs:
        run["hit_rate_vs_one_engine"] = ratio(run["hit_rate"], one)
    result = {
        "benchmark": "scale_out",
        "note": "engines on one machine share its cores: throughput does not scale here; "
        "compare hit rates, TTFT and the per-engine split",
        "shape": asdict(shape),
        "concurrency": args.concurrency,
        "runs": runs,
    }
    emit(result, args.out_dir, "scale_out")
    labels = [run["name"].replace("2 engines, ", "") for run in runs]
    bar_compare(labels, {"hit rate": [r["hit_rate"] for r in runs],
                         "vs one engine": [r["hit_rate_vs_one_engine"] for r in runs]},
                "Prefix hit rate by placement", "configuration", "fraction",
                args.out_dir / "scale_out.png")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
