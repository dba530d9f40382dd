"""Goodput: the highest request rate at which 90% of requests meet a latency objective.

Atrium beside vLLM, on the realistic chat workload under open-loop Poisson arrivals:

    python -m bench.goodput [--servers atrium vllm] [--rates 0.25 0.5 1 1.5 2 3 4]
                            [--duration 60] [--slo 2:0.2 1:0.1] [--attainment 0.9]

Each server is started once (never two at once) and swept up the rates. At each rate the
conversations of ``bench/chat_workload.py`` arrive at Poisson times for ``--duration`` seconds,
whatever is still running; a third have a follow-up, sent once the first answer is in, so
conversations arrive at rate / (1 + 1/3) and requests at about the rate. Then ``--drain`` seconds
more at most (default: long enough that no conversation whose turns meet the loosest objective is
cut off); failed and cut-off requests miss every objective. A rate's arrival times and
conversations follow from ``--seed`` and the rate: the same on every server, and different from
rate to rate, so one rate's cached prefixes do not help the next. A server stops climbing after
``--stop-after`` rates at which no objective reached ``--stop-below``. Goodput for an objective
is the highest measured rate at which it and every lower rate reached ``--attainment`` (not
interpolated); when that is the highest rate run, it is only a lower bound.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.chat_workload import FOLLOW_UP_FRACTION, Conversation, conversations, run_open_loop
from bench.common import emit, machine_info, quiet_logging, ratio
from bench.loadgen import poisson_offsets
from bench.metrics import RequestRecord, Slo, attainment, highest_sustained_rate, latency_summary
from bench.plots import curves
from bench.served import add_server_args, resolve_model, serving

DEFAULT_RATES = (0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0)  # requests/s; SmolLM2-135M on two cores
DEFAULT_SLOS = ("2:0.2", "1:0.1")  # TTFT seconds : TPOT seconds


@dataclass(frozen=True, slots=True)
class RatePlan:
    rate: float  # requests per second, nominal
    duration_s: float
    offsets: list[float]  # each conversation's arrival, seconds from the start
    items: list[Conversation]

    @property
    def offered_req_s(self) -> float:
        """The requests this draw of arrivals and follow-ups sends per second."""
        return sum(len(c.turns) for c in self.items) / self.duration_s


def parse_slo(text: str) -> Slo:
    ttft, _, tpot = text.partition(":")
    try:
        slo = Slo(float(ttft), float(tpot))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not TTFT_S:TPOT_S") from None
    if not (slo.ttft_s > 0 and slo.tpot_s > 0):
        raise argparse.ArgumentTypeError(f"{text!r}: both limits must be positive")
    return slo


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_server_args(parser, atrium_port=8321, vllm_port=8322)
    add = parser.add_argument
    add("--rates", type=float, nargs="+", default=list(DEFAULT_RATES), help="requests/s")
    add("--duration", type=float, default=60.0, help="seconds of arrivals per rate")
    add("--drain", type=float, default=None, help="seconds after the arrivals at most")
    add(
        "--slo",
        type=parse_slo,
        nargs="+",
        default=[parse_slo(s) for s in DEFAULT_SLOS],
        help="TTFT_S:TPOT_S each (default: 2:0.2 1:0.1)",
    )
    add("--attainment", type=float, default=0.9, help="fraction of requests to meet an SLO")
    add("--stop-below", type=float, default=0.5, help="an attainment under which a rate is low")
    add("--stop-after", type=int, default=2, help="rates below --stop-below (0: run all)")
    add("--tenants", type=int, default=4)
    add("--max-tokens", type=int, default=128)
    add("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if min(args.rates) <= 0 or args.duration <= 0 or not 0 < args.attainment <= 1:
        parser.error("rates and --duration must be positive, --attainment in (0, 1]")
    args.rates = sorted(set(args.rates))
    if args.drain is None:
        args.drain = default_drain(args.slo, args.max_tokens)
    return args


def default_drain(slos: Sequence[Slo], max_tokens: int, turns: int = 2) -> float:
    """Seconds after the last arrival within which a conversation of ``turns`` turns, each
    meeting the loosest objective, has finished: cutting off later ones costs no met request."""
    return turns * max(s.ttft_s + (max_tokens - 1) * s.tpot_s for s in slos)


def plan_rate(rate: float, duration_s: float, seed: int, tenants: int, max_tokens: int) -> RatePlan:
    """The arrivals and conversations of one rate; raises ValueError when the corpus has fewer
    passages than ``duration_s`` at ``rate`` needs."""
    rate_seed = seed + round(rate * 1000)
    offsets = poisson_offsets(rate / (1 + FOLLOW_UP_FRACTION), duration_s, rate_seed)
    items = conversations(tenants, len(offsets), rate_seed, max_tokens)
    return RatePlan(rate, duration_s, offsets, items)


def rate_point(
    plan: RatePlan, records: Sequence[RequestRecord], slos: Sequence[Slo]
) -> dict[str, Any]:
    """One rate's latencies, throughput and the fraction of requests meeting each objective."""
    return {
        "rate": plan.rate,
        "offered_req_s": plan.offered_req_s,
        "conversations": len(plan.items),
        **latency_summary(records),
        "attainment": {s.name: attainment(records, s) for s in slos},
    }


def sweep(
    plans: Sequence[RatePlan],
    run: Callable[[RatePlan], list[RequestRecord]],
    slos: Sequence[Slo],
    stop_below: float,
    stop_after: int,
) -> list[dict[str, Any]]:
    """Run the plans in order until ``stop_after`` of them (0: never) left every objective
    below ``stop_below``; one point per rate run."""
    points = []
    low = 0
    for plan in plans:
        point = rate_point(plan, run(plan), slos)
        points.append(point)
        low += all(not a >= stop_below for a in point["attainment"].values())
        if stop_after and low >= stop_after:
            break
    return points


def goodput(points: Sequence[dict[str, Any]], slos: Sequence[Slo], target: float) -> dict[str, Any]:
    """Per objective: the highest sustained rate (None: not even the lowest), and whether it is
    only a lower bound (the highest rate run still met the target)."""
    out: dict[str, Any] = {}
    top = max((p["rate"] for p in points), default=math.nan)
    for slo in slos:
        rate = highest_sustained_rate(
            {p["rate"]: p["attainment"][slo.name] for p in points}, target
        )
        out[slo.name] = {"rate": rate, "lower_bound": rate == top}
    return out


def compare(results: dict[str, dict[str, Any]], slos: Sequence[Slo]) -> dict[str, Any]:
    """Atrium's goodput over vLLM's per objective (>1: Atrium sustains more); null where either
    met no rate."""
    if "atrium" not in results or "vllm" not in results:
        return {}
    out: dict[str, Any] = {}
    for slo in slos:
        ours, theirs = results["atrium"]["goodput"][slo.name], results["vllm"]["goodput"][slo.name]
        both = ours["rate"] is not None and theirs["rate"] is not None
        out[slo.name] = {
            "ratio": ratio(ours["rate"], theirs["rate"]) if both else None,
            "lower_bounds": [
                n for n, g in (("atrium", ours), ("vllm", theirs)) if g["lower_bound"]
            ],
        }
    return out


def run_server(name: str, args: argparse.Namespace, plans: Sequence[RatePlan]) -> dict[str, Any]:
    """Start one server, sweep it up the rates, stop it."""
    tenants = [f"t{i}" for i in range(args.tenants)]
    with serving(name, args, tenants, {}) as served:

        def run(plan: RatePlan) -> list[RequestRecord]:
            deadline = args.duration + args.drain
            return asyncio.run(run_open_loop(served.target, plan.items, plan.offsets, deadline))

        points = sweep(plans, run, args.slo, args.stop_below, args.stop_after)
    return {
        "startup_s": served.startup_s,
        "rates": points,
        "stopped_early": len(points) < len(plans),
        "goodput": goodput(points, args.slo, args.attainment),
    }


def draw(results: dict[str, dict[str, Any]], slos: Sequence[Slo], target: float, out: Path) -> Path:
    series = {
        f"{server} {slo.name}": (
            [p["rate"] for p in r["rates"]],
            [p["attainment"][slo.name] for p in r["rates"]],
        )
        for server, r in results.items()
        for slo in slos
    }
    title = "realistic chat, Poisson arrivals: requests meeting the SLO"
    fraction = "fraction of requests"
    return curves(series, title, "requests/s", fraction, out, target, log_x=True, ylim=(0, 1.02))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        plans = [
            plan_rate(rate, args.duration, args.seed, args.tenants, args.max_tokens)
            for rate in args.rates
        ]
    except ValueError as exc:
        raise SystemExit(f"{exc}: lower --duration or the highest rate") from None
    quiet_logging()
    resolve_model(args)
    started = time.perf_counter()
    results = {name: run_server(name, args, plans) for name in args.servers}
    report: dict[str, Any] = {
        "machine": machine_info(),
        "dtype": args.dtype,
        "model": str(args.model_dir),
        "workload": {
            "tenants": args.tenants,
            "max_tokens": args.max_tokens,
            "duration_s": args.duration,
            "drain_s": args.drain,
            "seed": args.seed,
        },
        "slos": {s.name: {"ttft_s": s.ttft_s, "tpot_s": s.tpot_s} for s in args.slo},
        "attainment_target": args.attainment,
        "goodput_rule": "highest measured rate at which it and every lower rate met the target",
        "servers": results,
        "atrium_over_vllm": compare(results, args.slo),
        "seconds": time.perf_counter() - started,
    }
    report["plots"] = [str(draw(results, args.slo, args.attainment, args.out_dir / "goodput.png"))]
    emit(report, args.out_dir, "goodput")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
