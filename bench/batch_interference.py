"""Interactive TTFT with and without a large Batch API job running, side by side.

Starts `atrium serve`, sends the same Poisson stream of streamed completions twice from one
tenant (alone, then while that tenant's large batch runs at its lower fair-share weight), and
writes the two latency summaries, the TTFT p99 ratio (goal: at most 1.3) and a bar plot.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.common import DEFAULT_OUT_DIR, emit, ratio
from bench.loadgen import RequestSpec, Target, run_poisson
from bench.metrics import RequestRecord, latency_summary, percentile
from bench.plots import bar_compare
from bench.servers import atrium_env, create_tenant_keys, start_atrium, stop, wait_ready

GOAL_TTFT_P99_RATIO = 1.3
PROMPT = "Summarize why the sky looks blue in two sentences. " * 4
BATCH_PROMPT = "Write a short story about a lighthouse keeper and a storm."


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default", help="default, or a model dir / .gguf")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--port", type=int, default=8431)
    parser.add_argument("--requests", type=int, default=64, help="interactive requests per run")
    parser.add_argument("--rate", type=float, default=2.0, help="interactive requests per second")
    parser.add_argument("--max-tokens", type=int, default=32, help="per interactive request")
    parser.add_argument("--batch-lines", type=int, default=2000)
    parser.add_argument("--batch-max-tokens", type=int, default=128)
    parser.add_argument("--batch-concurrency", type=int, default=16)
    parser.add_argument("--batch-weight-fraction", type=float, default=0.1)
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR)
    return parser.parse_args(argv)


def compare(alone: list[RequestRecord], with_batch: list[RequestRecord]) -> dict[str, Any]:
    """Both runs' summaries and the TTFT ratios (with the batch over alone)."""
    ttft_a = [r.ttft for r in alone if r.ok]
    ttft_b = [r.ttft for r in with_batch if r.ok]
    p99_a, p99_b = percentile(ttft_a, 99), percentile(ttft_b, 99)
    p50_ratio = ratio(percentile(ttft_b, 50), percentile(ttft_a, 50))
    p99_ratio = ratio(p99_b, p99_a)
    return {
        "alone": latency_summary(alone),
        "with_batch": latency_summary(with_batch),
        "ttft_p50_ratio": p50_ratio,
        "ttft_p99_ratio": p99_ratio,
        "goal_ttft_p99_ratio": GOAL_TTFT_P99_RATIO,
        "within_goal": not math.isnan(p99_ratio) and p99_ratio <= GOAL_TTFT_P99_RATIO,
    }


def batch_file(model: str, lines: int, max_tokens: int) -> bytes:
    rows = []
    for n in range(lines):
        body = {
            "model": model,
            "messages": [{"role": "user", "content": f"{BATCH_PROMPT} ({n})"}],
            "max_tokens": max_tokens,
            "temperature": 0.7,
            "seed": n,
        }
        line = {"custom_id": f"line-{n}", "method": "POST", "url": "/v1/chat/completions"}
        rows.append(json.dumps({**line, "body": body}))
    return ("\n".join(rows) + "\n").encode()


def start_batch(base_url: str, key: str, model: str, args: argparse.Namespace) -> str:
    """Upload and create the batch; returns its id once some of its lines have finished."""
    auth = {"Authorization": f"Bearer {key}"}
    with httpx.Client(base_url=base_url, headers=auth, timeout=60.0, trust_env=False) as http:
        content = batch_file(model, args.batch_lines, args.batch_max_tokens)
        upload = http.post(
            "/v1/files", files={"file": ("batch.jsonl", content)}, data={"purpose": "batch"}
        )
        upload.raise_for_status()
        created = http.post(
            "/v1/batches",
            json={
                "input_file_id": upload.json()["id"],
                "endpoint": "/v1/chat/completions",
                "completion_window": "24h",
            },
        )
        created.raise_for_status()
        batch_id = str(created.json()["id"])
        deadline = time.monotonic() + 300.0
        while time.monotonic() < deadline:  # the batch is running once a line has finished
            if batch_status(http, batch_id)["request_counts"]["completed"] > 0:
                return batch_id
            time.sleep(0.5)
        raise TimeoutError("the batch finished no line within 300 s")


def batch_status(http: httpx.Client, batch_id: str) -> dict[str, Any]:
    response = http.get(f"/v1/batches/{batch_id}")
    response.raise_for_status()
    result: dict[str, Any] = response.json()
    return result


def finish_batch(base_url: str, key: str, batch_id: str) -> dict[str, Any]:
    """The batch's state when the measured run ended, then it is cancelled."""
    auth = {"Authorization": f"Bearer {key}"}
    with httpx.Client(base_url=base_url, headers=auth, timeout=60.0, trust_env=False) as http:
        state = batch_status(http, batch_id)
        http.post(f"/v1/batches/{batch_id}/cancel")
    return {"status": state["status"], "request_counts": state["request_counts"]}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    specs = [RequestSpec("online", PROMPT, args.max_tokens) for _ in range(args.requests)]
    with tempfile.TemporaryDirectory(prefix="atrium-batch-bench-") as tmp:
        work = Path(tmp)
        env = atrium_env(work) | {
            "ATRIUM_BATCH_MAX_CONCURRENCY": str(args.batch_concurrency),
            "ATRIUM_BATCH_WEIGHT_FRACTION": str(args.batch_weight_fraction),
            "ATRIUM_BATCH_POLL_S": "0.2",
        }
        server = start_atrium(Path(args.model), args.port, work, work / "logs", args.dtype, env)
        try:
            wait_ready(server, "/readyz", 600.0)
            keys = create_tenant_keys(["online"], env)
            models = httpx.get(
                server.base_url + "/v1/models",
                headers={"Authorization": f"Bearer {keys['online']}"},
                trust_env=False,
            ).json()
            target = Target(server.base_url, models["data"][0]["id"], keys)
            asyncio.run(run_poisson(target, specs[:2], rate=args.rate))  # warm-up, untimed
            alone = asyncio.run(run_poisson(target, specs, rate=args.rate))
            batch_id = start_batch(server.base_url, keys["online"], target.model, args)
            with_batch = asyncio.run(run_poisson(target, specs, rate=args.rate))
            batch = finish_batch(server.base_url, keys["online"], batch_id)
        finally:
            stop(server)
    result = {
        "bench": "batch_interference",
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        **compare(alone, with_batch),
        "batch": batch,
    }
    emit(result, args.out_dir, "batch_interference")
    summaries = (result["alone"]["ttft_s"], result["with_batch"]["ttft_s"])
    bar_compare(
        ["TTFT p50", "TTFT p99"],
        {
            "interactive alone": [summaries[0]["p50"], summaries[0]["p99"]],
            "with a batch running": [summaries[1]["p50"], summaries[1]["p99"]],
        },
        "Interactive TTFT with and without a batch",
        "",
        "seconds",
        args.out_dir / "batch_interference.png",
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
