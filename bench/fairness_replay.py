"""The weights part of ``bench.fairness`` through the scheduler on a virtual clock.

    python -m bench.fairness_replay [--window 40] [--orders w1 w4]
                                    [--machine FIXED,DECODE,CONTEXT,PROMPT,PROMPT_CONTEXT]
                                    [--calibration FIXED,DECODE,CONTEXT,PROMPT]

Tenants of weights 1, 2 and 4 start ``--stagger`` seconds apart (in each arrival order) and each
keeps ``--in-flight`` requests of ``--prompt-len`` fresh prompt tokens and ``--output-len``
output tokens in flight, as ``bench.fairness`` does against ``atrium serve`` with its defaults.
The requests go through the engine's own scheduler, fair-share policy, radix cache and step
target (``bench.schedule_replay.build_scheduler``); each step's time is modelled by
``--machine``. Counted over the window that opens ``--warmup`` seconds after the last start:

- ``share_over_weighted_share``: each tenant's output tokens over its weighted share, the
  figure ``bench.fairness`` reports;
- ``service_over_weighted_share``: the same for the service the fair-share counters charge
  (prompt and output tokens at their costs, ``FairSharePolicy.counter`` times the weight);
- ``mean_running``: requests each tenant holds in the running batch, averaged over the steps.

Output tokens and service part where a tenant's running requests are not in their steady
number: one that took the slots before the others came ends its requests in the window (output
whose prompts were charged before it), while a newcomer's admissions add prompts. It runs in
seconds and the same every time; it compares policies and machines, it does not measure one.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.common import emit, quiet_logging
from bench.fairness_runs import ORDERS, WEIGHTS, weighted_shares
from bench.schedule_replay import (
    CALIBRATION,
    MACHINE,
    Machine,
    _calibration,
    _floats,
    build_scheduler,
    run_step,
)
from engine.request import Request, owner_tag
from engine.sampling_params import SamplingParams
from engine.step_target import StepCosts
from radix_cache.prefix_cache import tenant_namespace


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--orders", nargs="+", default=["w1", "w4"], choices=sorted(ORDERS))
    add("--window", type=float, default=40.0, help="seconds of counted service per run")
    add("--warmup", type=float, default=12.0, help="seconds after the last tenant starts")
    add("--stagger", type=float, default=4.0, help="seconds between the tenants' starts")
    add("--in-flight", type=int, default=32, help="per tenant")
    add("--prompt-len", type=int, default=96)
    add("--output-len", type=int, default=48)
    add("--target-ttft-ms", type=float, default=2000.0, help="as atrium serve's default")
    add("--machine", type=lambda t: Machine(*_floats(t, 5)), default=MACHINE)
    add("--calibration", type=_calibration, default=CALIBRATION)
    add("--seed", type=int, default=0)
    add("--out-dir", type=Path, default=Path("bench/out"))
    args = parser.parse_args(argv)
    if min(args.window, args.in_flight, args.prompt_len, args.output_len) <= 0:
        parser.error("--window, --in-flight, --prompt-len and --output-len must be positive")
    if min(args.stagger, args.warmup) < 0:
        parser.error("--stagger and --warmup must not be negative")
    return args


def weighted_replay(
    order: Sequence[str],
    machine: Machine,
    calibration: StepCosts,
    *,
    weights: Mapping[str, float] = WEIGHTS,
    in_flight: int = 32,
    prompt_len: int = 96,
    output_len: int = 48,
    stagger_s: float = 4.0,
    warmup_s: float = 12.0,
    window_s: float = 40.0,
    ttft_target_s: float = 2.0,
    seed: int = 0,
) -> dict[str, Any]:
    """One arrival ``order`` of closed-loop tenants served until the window ends."""
    now = 0.0
    scheduler, target = build_scheduler(calibration, ttft_target_s, lambda: now)
    policy = scheduler.policy
    ids = random.Random(seed)
    starts = {tenant: stagger_s * i for i, tenant in enumerate(order)}
    window_start = stagger_s * (len(order) - 1) + warmup_s
    window_end = window_start + window_s
    tokens = dict.fromkeys(order, 0)
    running = dict.fromkeys(order, 0)
    counters: dict[str, float] | None = None
    num_steps = num_sent = 0

    def send(tenant: str) -> None:
        nonlocal num_sent
        request_id = f"r{num_sent}"
        scheduler.add(
            Request(
                request_id=request_id,
                prompt_token_ids=[ids.randrange(1000, 40000) for _ in range(prompt_len)],
                params=SamplingParams(max_tokens=output_len, temperature=0.7, ignore_eos=True),
                tenant_id=tenant,
                namespace=tenant_namespace(tenant),
                owner=owner_tag(request_id),
                arrival_index=num_sent,
                arrived_at=now,
                tenant_weight=weights[tenant],
            )
        )
        num_sent += 1

    while now < window_end:
        for tenant in [t for t in starts if starts[t] <= now]:
            del starts[tenant]
            for _ in range(in_flight):
                send(tenant)
        if not scheduler.has_unfinished:
            now = min(starts.values())
            continue
        if counters is None and now >= window_start:
            counters = {t: policy.service(t) for t in order}
        out = scheduler.schedule()
        now += run_step(out, machine, target)
        scheduler.postprocess(out)
        counted = window_start <= now < window_end
        if counted:
            num_steps += 1
            for request in scheduler.running:
                running[request.tenant_id] += 1
        for seq in out.seqs:
            request = seq.request
            if not seq.sample or request.is_finished:
                continue
            request.append_token(ids.randrange(1000, 40000))
            if counted:
                tokens[request.tenant_id] += 1
            if request.num_output_tokens >= output_len:
                scheduler.finish(request, "length")
                send(request.tenant_id)
    start = counters or {t: policy.service(t) for t in order}
    service = {t: (policy.service(t) - start[t]) * weights[t] for t in order}
    return {
        "order": list(order),
        "tokens": tokens,
        "output_tok_s": sum(tokens.values()) / window_s,
        "share_over_weighted_share": weighted_shares(tokens, weights),
        "service_over_weighted_share": weighted_shares(service, weights),
        "mean_running": {t: running[t] / max(num_steps, 1) for t in order},
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    quiet_logging()
    runs = {
        f"{first}_first": weighted_replay(
            ORDERS[first],
            args.machine,
            args.calibration,
            in_flight=args.in_flight,
            prompt_len=args.prompt_len,
            output_len=args.output_len,
            stagger_s=args.stagger,
            warmup_s=args.warmup,
            window_s=args.window,
            ttft_target_s=args.target_ttft_ms / 1000,
            seed=args.seed,
        )
        for first in args.orders
    }
    report = {
        "machine": asdict(args.machine),
        "calibration": asdict(args.calibration),
        "weights": WEIGHTS,
        "window_s": args.window,
        "runs": runs,
    }
    emit(report, args.out_dir, "fairness_replay")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
