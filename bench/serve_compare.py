"""Atrium against vLLM's CPU build over HTTP, the same workloads on each server in turn.

    python -m bench.serve_compare [--servers atrium vllm] [--workloads realistic synthetic]
                                  [--tenants 2 --groups 2 --prompts 8] [--rounds 3]

Starts each server on 127.0.0.1 (never both at once), runs the suite (realistic chat at
``--realistic-concurrency``: documentation text under the chat template, half sampled, a third
with a second turn, natural stops, see ``bench/chat_workload.py``; then the synthetic runs of
vocabulary words with ``ignore_eos``: shared prefix at each concurrency, optional Poisson
arrivals, multi-turn chat, one tenant flooding), stops it, then prints JSON with Atrium/vLLM
ratios and writes PNG plots. ``atrium-nodrafts`` is Atrium with n-gram drafts off. With
``--rounds N`` the servers take turns N times (the order reversed every other round, so that a
machine slowing down or speeding up over the run favours neither), each round's ratios are kept,
and the headline ratios are their medians: on a shared machine one round's ratio can move by
tens of percent with the minute it ran in.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

from bench.common import emit, machine_info, quiet_logging, ratio
from bench.serve_plots import draw_plots
from bench.serve_suite import SuiteConfig, run_suite
from bench.served import add_server_args, resolve_model, serving
from bench.text_workloads import TextShape, word_vocab


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_server_args(parser)
    add = parser.add_argument
    add("--workloads", nargs="+", default=["realistic", "synthetic"])
    add("--realistic-concurrency", type=int, nargs="+", default=[8, 32])
    add("--realistic-max-tokens", type=int, default=128)
    add("--tenants", type=int, default=2)
    add("--groups", type=int, default=2)
    add("--prompts", type=int, default=8)
    add("--system-len", type=int, default=512)
    add("--question-len", type=int, default=64)
    add("--output-len", type=int, default=32)
    add("--concurrency", type=int, nargs="+", default=[4, 16])
    add("--rate", type=float, default=None, help="also a Poisson run at this many req/s")
    add("--chat-users", type=int, default=4)
    add("--chat-turns", type=int, default=3)
    add("--flood-per-tenant", type=int, default=8)
    add("--flood-factor", type=int, default=10)
    add("--flood-concurrency", type=int, default=4, help="each normal tenant's; t0 has ×factor")
    add("--deadline", type=float, default=300.0, help="seconds per run at most")
    add("--rounds", type=int, default=1, help="times the servers take turns (ratios: medians)")
    return parser.parse_args(argv)


def run_server(name: str, args: argparse.Namespace, config: SuiteConfig) -> dict[str, Any]:
    """Start one server, run the suite against it, stop it."""
    tenants = [f"t{i}" for i in range(max(args.tenants, 4))]
    with serving(name, args, tenants, {"ignore_eos": True}) as served:
        result = asyncio.run(run_suite(served.target, config))
    return {"startup_s": served.startup_s, **result}


def compare(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Atrium / vLLM for the headline numbers of each run (>1: Atrium higher)."""
    if "atrium" not in results or "vllm" not in results:
        return {}
    return ratios(results["atrium"], results["vllm"])


def ratios(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, Any]:
    """``ours`` over ``theirs`` for each run both have (>1: ours higher)."""
    out: dict[str, Any] = {}
    for run in ours["runs"]:
        other = theirs["runs"].get(run)
        if other is None:
            continue
        a, v = ours["runs"][run], other
        out[run] = {
            "output_tok_s": ratio(a["output_tok_s"], v["output_tok_s"]),
            "ttft_p50": ratio(a["ttft_s"]["p50"], v["ttft_s"]["p50"]),
            "ttft_p99": ratio(a["ttft_s"]["p99"], v["ttft_s"]["p99"]),
            "tpot_p50": ratio(a["tpot_s"]["p50"], v["tpot_s"]["p50"]),
        }
    if not ours.get("flood") or not theirs.get("flood"):
        return out
    out["flood_jain"] = {
        "atrium": ours["flood"]["jain_index"],
        "vllm": theirs["flood"]["jain_index"],
    }
    for key in ("p99_ttft_over_solo", "p99_ttft_over_without_flooder"):
        out[f"flood_{key}"] = {"atrium": ours["flood"][key], "vllm": theirs["flood"][key]}
    return out


def median_ratios(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The median over rounds of each run's ratios (``compare`` of one round each: every ratio
    is of two servers measured in the same round), with each round's values under ``rounds``;
    the flood's per-server figures stay per round (``flood_rounds``)."""
    if not rounds or not rounds[0]:  # one server only: nothing to compare
        return {}
    out: dict[str, Any] = {}
    for run, first in rounds[0].items():
        if run.startswith("flood_"):
            continue
        present = [r[run] for r in rounds if run in r]
        out[run] = {metric: statistics.median(p[metric] for p in present) for metric in first}
        out[run]["rounds"] = {metric: [p[metric] for p in present] for metric in first}
    out["flood_rounds"] = [{k: v for k, v in r.items() if k.startswith("flood_")} for r in rounds]
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.rounds < 1:
        raise SystemExit("--rounds must be at least 1")
    quiet_logging()
    resolve_model(args)
    words = word_vocab(args.model_dir / "tokenizer.json")
    shape = TextShape(
        args.tenants, args.groups, args.prompts, args.system_len, args.question_len, args.output_len
    )
    config = SuiteConfig(
        words=words,
        tokenizer_json=args.model_dir / "tokenizer.json",
        shape=shape,
        concurrency=tuple(args.concurrency),
        rate=args.rate,
        chat_users=args.chat_users,
        chat_turns=args.chat_turns,
        flood_per_tenant=args.flood_per_tenant,
        flood_factor=args.flood_factor,
        flood_concurrency=args.flood_concurrency,
        deadline_s=args.deadline,
        workloads=tuple(args.workloads),
        realistic_concurrency=tuple(args.realistic_concurrency),
        realistic_max_tokens=args.realistic_max_tokens,
    )
    started = time.perf_counter()
    rounds = []
    for i in range(args.rounds):
        order = args.servers if i % 2 == 0 else args.servers[::-1]
        rounds.append({name: run_server(name, args, config) for name in order})
    results = rounds[0]  # every number of the first round, for the plots
    report: dict[str, Any] = {
        "shape": repr(shape),
        "machine": machine_info(),
        "dtype": args.dtype,
        "servers": results,
        "atrium_over_vllm": (
            compare(results) if len(rounds) == 1 else median_ratios([compare(r) for r in rounds])
        ),
        "rounds": len(rounds),
        "drafts_over_nodrafts": [
            ratios(r["atrium"], r["atrium-nodrafts"])
            for r in rounds
            if "atrium" in r and "atrium-nodrafts" in r
        ],
        "seconds": time.perf_counter() - started,
    }
    report["plots"] = [str(p) for p in draw_plots(results, args.out_dir)]
    emit(report, args.out_dir, "serve_compare")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
