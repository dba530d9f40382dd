"""Weighted fair share over HTTP: tenants of weights 1, 2 and 4 in both regimes, and a flood.

    python -m bench.fairness [--window 40] [--flood-rounds 2] [--parts weights flood]

Regimes: "defaults" is the server as ``atrium serve`` starts it (no setting changed: its slots,
step-time target and first-token target), each tenant keeping ``--defaults-in-flight`` requests
in flight, together more than the default slots; "slots" keeps more requests in flight than the
running batch holds (``--slots`` running, each tenant ``--slots-in-flight``, no step-time
target); "latency" keeps them all within
the slots (``--latency-slots``) and lets the engine's step-time target (the default, auto) form
the queue: each tenant keeps more in flight than its weighted share of what the target lets run.
Each regime runs in both arrival orders (weight 1 first, weight 4 first), every run on fresh
prompts. Prints JSON (each tenant's share over its weighted share; the flood's TTFT ratios) and
writes PNG plots.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import DEFAULT_OUT_DIR, emit, quiet_logging
from bench.fairness_runs import ORDERS, WEIGHTS, Load, flood_run, weighted_run
from bench.loadgen import RequestSpec, Target, run_closed_loop
from bench.plots import bar_compare
from bench.servers import atrium_cli, atrium_env, export_model, start_atrium, stop, wait_ready
from bench.text_workloads import word_vocab
from engine.device import dtype_name, resolve_dtype

LIGHT = ("light1", "light2", "light3")
FLOODER = "flooder"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--parts", nargs="+", default=["weights", "flood"], choices=["weights", "flood"])
    add(
        "--regimes",
        nargs="+",
        default=["defaults", "slots", "latency"],
        choices=["defaults", "slots", "latency"],
    )
    add(
        "--orders",
        nargs="+",
        default=["w1", "w4"],
        choices=["w1", "w4"],
        help="arrival orders to run, by the first tenant (w1: 1, 2, 4; w4: 4, 2, 1)",
    )
    add("--window", type=float, default=40.0, help="seconds of counted service per run")
    add("--warmup", type=float, default=12.0, help="seconds after the last tenant starts")
    add("--stagger", type=float, default=4.0, help="seconds between the tenants' starts")
    add("--defaults-in-flight", type=int, default=32, help="per tenant, defaults regime")
    add("--slots", type=int, default=24, help="running batch of the slots regime")
    add("--slots-in-flight", type=int, default=24, help="per tenant, slots regime")
    add("--latency-slots", type=int, default=128, help="running batch of the latency regime")
    add(
        "--latency-in-flight",
        type=int,
        default=32,
        help="per tenant, latency regime: all "
        "within its slots, and more than the step-time target lets run on a small CPU",
    )
    add("--prompt-len", type=int, default=96)
    add("--output-len", type=int, default=48)
    add("--flood-rounds", type=int, default=2)
    add("--flood-duration", type=float, default=40.0)
    add("--flood-in-flight", type=int, default=2, help="each light tenant's; the flooder ×10")
    add("--eos", action="store_true", help="let answers end at EOS (default: ignore_eos)")
    add("--env", nargs="*", default=[], help="extra ATRIUM_*=VALUE settings for the server")
    add("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    add("--port", type=int, default=8321)
    add("--out-dir", type=Path, default=DEFAULT_OUT_DIR)
    return parser.parse_args(argv)


class Server:
    """`atrium serve` on the exported default model with its tenants, for one part's runs."""

    def __init__(self, args: argparse.Namespace, tmp: Path, settings: dict[str, str]) -> None:
        self.env = atrium_env(tmp)
        self.env.pop("ATRIUM_MAX_NUM_SEQS")  # the server's own defaults unless a run sets them
        self.env.pop("ATRIUM_KV_CACHE_BYTES")
        self.env.update(settings)
        self.env.update(dict(item.split("=", 1) for item in args.env))
        self.keys: dict[str, str] = {}
        for name, weight in [*WEIGHTS.items(), *((t, 1.0) for t in (*LIGHT, FLOODER))]:
            tenant = json.loads(
                atrium_cli("tenants", "create", name, "--weight", str(weight), env=self.env)
            )
            self.keys[name] = json.loads(atrium_cli("keys", "create", tenant["id"], env=self.env))[
                "key"
            ]
        self.server = start_atrium(
            args.model_dir, args.port, tmp, args.out_dir / "logs", args.dtype, env=self.env
        )
        wait_ready(self.server, "/readyz", 600)
        extra = {"temperature": 0.7, "ignore_eos": not args.eos}
        self.target = Target(self.server.base_url, args.model_dir.name, self.keys, extra)
        asyncio.run(run_closed_loop(self.target, [RequestSpec("w1", " hello" * 8, 4)], 1, 300))

    @property
    def admin_token(self) -> str:
        return self.env["ATRIUM_ADMIN_TOKEN"]


def run_weights(args: argparse.Namespace, load: Load) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for regime in args.regimes:
        settings, in_flight = {
            "defaults": ({}, args.defaults_in_flight),
            "slots": (
                {"ATRIUM_MAX_NUM_SEQS": str(args.slots), "ATRIUM_TARGET_TPOT_MS": "off"},
                args.slots_in_flight,
            ),
            "latency": ({"ATRIUM_MAX_NUM_SEQS": str(args.latency_slots)}, args.latency_in_flight),
        }[regime]
        with tempfile.TemporaryDirectory(prefix="atrium-fair-") as tmp:
            server = Server(args, Path(tmp), settings)
            try:
                for order in (ORDERS[first] for first in args.orders):
                    run = weighted_run(
                        server.target,
                        load,
                        WEIGHTS,
                        order,
                        in_flight,
                        args.stagger,
                        args.warmup,
                        args.window,
                        server.admin_token,
                    )
                    out[f"{regime}_{order[0]}_first"] = {"regime": regime, **asyncio.run(run)}
            finally:
                stop(server.server)
    return out


def run_floods(args: argparse.Namespace, load: Load) -> list[dict[str, Any]]:
    rounds = []
    with tempfile.TemporaryDirectory(prefix="atrium-fair-") as tmp:
        server = Server(args, Path(tmp), {})
        try:
            for i in range(args.flood_rounds):
                run = flood_run(
                    server.target,
                    load,
                    LIGHT,
                    FLOODER,
                    args.flood_in_flight,
                    10,
                    args.flood_duration,
                    seed=5000 + 1000 * i,
                )
                rounds.append(asyncio.run(run))
        finally:
            stop(server.server)
    return rounds


def draw(result: dict[str, Any], out_dir: Path) -> list[Path]:
    paths = []
    runs = result.get("weights", {})
    if runs:
        labels = list(runs)
        series = {t: [runs[r]["share_over_weighted_share"][t] for r in labels] for t in WEIGHTS}
        title = "share of tokens over weighted share (1.0 = exactly the weight)"
        paths.append(bar_compare(labels, series, title, "run", "ratio", out_dir / "fair_w.png"))
    floods = result.get("flood", [])
    if floods:
        labels = [f"round {i + 1}" for i in range(len(floods))]
        series = {t: [f["p99_ratio"][t] for f in floods] for t in LIGHT}
        title = "light tenants' p99 TTFT with the flooder over without"
        paths.append(bar_compare(labels, series, title, "", "ratio", out_dir / "fair_flood.png"))
    return paths


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    quiet_logging()
    if args.dtype == "auto":
        args.dtype = dtype_name(resolve_dtype("auto", torch.device("cpu")))
    args.model_dir = export_model(DEFAULT_OUT_DIR / f"smollm2-hf-{args.dtype}", args.dtype)
    load = Load(word_vocab(args.model_dir / "tokenizer.json"), args.prompt_len, args.output_len)
    started = time.perf_counter()
    result: dict[str, Any] = {"dtype": args.dtype, "weights_by_tenant": WEIGHTS}
    if "weights" in args.parts:
        result["weights"] = run_weights(args, load)
    if "flood" in args.parts:
        result["flood"] = run_floods(args, load)
    result["seconds"] = time.perf_counter() - started
    result["plots"] = [str(p) for p in draw(result, args.out_dir)]
    emit(result, args.out_dir, "fairness")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
