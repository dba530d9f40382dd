"""The goodput workload through the scheduler on a virtual clock: scheduling policy, no model.

    python -m bench.schedule_replay [--rates 0.25 0.5 1 2] [--duration 60] [--seeds 0 1 2 3]
                                    [--machine FIXED,DECODE,CONTEXT,PROMPT,PROMPT_CONTEXT]
                                    [--calibration FIXED,DECODE,CONTEXT,PROMPT]

The conversations and Poisson arrivals of ``bench.goodput`` (the same plan per rate and seed),
tokenized with the default model's chat template, go through the engine's own ``Scheduler``,
fair-share policy, radix prefix cache and step-time target, as ``atrium serve`` builds them.
Each step's time is not measured but modelled by ``--machine``: seconds once, per decode row,
per token a decode attends to, per prompt token and per token of context a prompt token attends
to. The step target is given ``--calibration`` as the costs it measured at start; it corrects
its scales from the modelled steps as it does from measured ones. Answers run to a length drawn
per request (most to ``--max-tokens``); a follow-up is sent when its first answer ends.

The defaults are fitted to a 2-core AMD EPYC (family 25, model 17) at bfloat16, where, before
Moore and Hodgson's rule (decision 66), this replay gave 81 / 97 / 44 / 18% of requests within
2 s / 200 ms at 0.25 / 0.5 / 1 / 2 req/s against the served engine's 81 / 97 / 53 / 23%. It
runs in seconds and the same every time: it compares policies, it does not measure a machine
(``bench.goodput`` does). The JSON has, per seed and rate, what ``bench.goodput`` reports for
a rate; the plot, each objective's attainment over the seeds.
"""

from __future__ import annotations

import argparse
import heapq
import random
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.chat_workload import chat_messages
from bench.common import emit, quiet_logging
from bench.goodput import DEFAULT_SLOS, RatePlan, goodput, parse_slo, plan_rate, rate_point
from bench.metrics import RequestRecord, Slo
from bench.plots import curves
from engine.config import EngineConfig
from engine.fair_share import FairSharePolicy
from engine.model.loader import load_tokenizer
from engine.request import Request, owner_tag
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput
from engine.step_target import StepCosts, StepTarget
from engine.tokenizer import Tokenizer
from radix_cache.page_pool import PagePool
from radix_cache.prefix_cache import tenant_namespace
from radix_cache.radix_prefix_cache import RadixPrefixCache

MACHINE = "0.0089,0.00085,2.7e-6,0.00066,2.1e-7"  # the EPYC's steps, fitted
CALIBRATION = "0.0105,0.00059,1.97e-6,0.0006"  # what its engine measured at start
NUM_PAGES = 11_650  # 4 GiB of SmolLM2-135M's KV at bfloat16, 16 tokens a page
SHORTER_ANSWERS = 0.2  # of requests, ending before max_tokens at a uniform length


@dataclass(frozen=True, slots=True)
class Machine:
    """Seconds a step takes: once, per decode row, per token a decode attends to, per prompt
    token, per token of context each prompt token attends to."""

    fixed_s: float
    per_decode_s: float
    per_context_token_s: float
    per_prompt_token_s: float
    per_prompt_context_s: float

    def step_s(self, decode_contexts: Sequence[int], chunks: Sequence[tuple[int, int]]) -> float:
        """A step of decodes over these contexts and prompt chunks (start, tokens)."""
        seconds = self.fixed_s + sum(
            self.per_decode_s + self.per_context_token_s * c for c in decode_contexts
        )
        for start, tokens in chunks:
            middle = start + tokens / 2
            seconds += tokens * (self.per_prompt_token_s + self.per_prompt_context_s * middle)
        return seconds


def _floats(text: str, count: int) -> list[float]:
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {count} numbers") from None
    if len(values) != count or not all(v >= 0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: {count} non-negative numbers")
    return values


def _calibration(text: str) -> StepCosts:
    fixed, decode, context, prompt = _floats(text, 4)
    return StepCosts(
        fixed_s=fixed, per_decode_s=decode, per_context_token_s=context, per_prefill_token_s=prompt
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--rates", type=float, nargs="+", default=[0.25, 0.5, 1.0, 2.0], help="requests/s")
    add("--duration", type=float, default=60.0, help="seconds of arrivals per rate")
    add("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    add("--tenants", type=int, default=4)
    add("--max-tokens", type=int, default=128)
    add("--slo", type=parse_slo, nargs="+", default=[parse_slo(s) for s in DEFAULT_SLOS])
    add("--target-ttft-ms", type=float, default=2000.0, help="as atrium serve's default")
    add("--machine", type=lambda t: Machine(*_floats(t, 5)), default=MACHINE)
    add("--calibration", type=_calibration, default=CALIBRATION)
    add("--out-dir", type=Path, default=Path("bench/out"))
    args = parser.parse_args(argv)
    if min(args.rates) <= 0 or args.duration <= 0:
        parser.error("rates and --duration must be positive")
    return args


def build_scheduler(
    calibration: StepCosts, ttft_target_s: float, clock: Callable[[], float]
) -> tuple[Scheduler, StepTarget]:
    """The scheduler ``atrium serve`` builds (fair share, radix cache, the default slots and
    budget, a step target derived from ``calibration``) on the clock ``clock``."""
    cache = RadixPrefixCache(PagePool(NUM_PAGES), 16)
    policy = FairSharePolicy()

    def cached(request: Request) -> int:
        tokens = request.all_token_ids[:-1]
        return cache.match(request.namespace, tokens, request.allow_public_prefix).num_tokens

    policy.bind_prefix_len(cached)
    target = StepTarget(calibration.auto_target_s(), calibration, min_prefill_tokens=16)
    config = EngineConfig()
    scheduler = Scheduler(
        cache,
        policy,
        config.token_budget,
        config.max_num_seqs,
        target=target,
        ttft_target_s=ttft_target_s,
        clock=clock,
    )
    return scheduler, target


def replay(
    plan: RatePlan,
    tokenizer: Tokenizer,
    machine: Machine,
    calibration: StepCosts,
    ttft_target_s: float,
    seed: int,
) -> list[RequestRecord]:
    """Every request of ``plan`` served to its end on the virtual clock, as the client sees it."""
    now = 0.0
    scheduler, target = build_scheduler(calibration, ttft_target_s, lambda: now)
    lengths = random.Random(seed)
    arrivals = [(at, i, 0) for i, at in enumerate(plan.offsets)]  # (time, conversation, turn)
    heapq.heapify(arrivals)
    answers: dict[int, list[str]] = {i: [] for i in range(len(plan.items))}
    live: dict[str, tuple[int, int, int, RequestRecord]] = {}  # id -> conv, turn, length, record
    records: list[RequestRecord] = []
    while arrivals or scheduler.has_unfinished:
        while arrivals and arrivals[0][0] <= now:
            at, conversation, turn = heapq.heappop(arrivals)
            item = plan.items[conversation]
            ids = tokenizer.apply_chat_template(chat_messages(item, answers[conversation], turn))
            request_id = f"r{len(records) + len(live)}"
            request = Request(
                request_id=request_id,
                prompt_token_ids=ids,
                params=SamplingParams(max_tokens=item.max_tokens, temperature=0.0),
                tenant_id=item.tenant,
                namespace=tenant_namespace(item.tenant),
                owner=owner_tag(request_id),
                arrival_index=len(records) + len(live),
                arrived_at=at,
            )
            length = item.max_tokens
            if lengths.random() < SHORTER_ANSWERS:
                length = lengths.randint(max(1, item.max_tokens // 6), item.max_tokens)
            live[request_id] = (conversation, turn, length, RequestRecord(item.tenant, at))
            scheduler.add(request)
        if not scheduler.has_unfinished:
            now = arrivals[0][0]
            continue
        out = scheduler.schedule()
        now += run_step(out, machine, target)
        scheduler.postprocess(out)
        for seq in out.seqs:
            request = seq.request
            if not seq.sample or request.is_finished:
                continue
            conversation, turn, length, record = live[request.request_id]
            request.append_token(lengths.randrange(1000, 40000))
            record.token_times.append(now)
            if request.num_output_tokens < length:
                continue
            scheduler.finish(request, "length")
            del live[request.request_id]
            record.done_at = now
            record.prompt_tokens = request.num_prompt_tokens
            record.cached_tokens = max(request.num_cached_tokens, 0)
            record.completion_tokens = request.num_output_tokens
            records.append(record)
            answers[conversation].append(tokenizer.decode(request.output_token_ids))
            if turn + 1 < len(plan.items[conversation].turns):
                heapq.heappush(arrivals, (now, conversation, turn + 1))
    return records


def run_step(out: SchedulerOutput, machine: Machine, target: StepTarget) -> float:
    """The modelled step's seconds, told to the step target as a measured step's would be."""
    decodes = out.seqs[: out.num_decodes]
    contexts = [seq.request.num_computed_tokens for seq in decodes]
    chunks = [(s.request.num_computed_tokens, s.num_new_tokens) for s in out.seqs[len(decodes) :]]
    seconds = machine.step_s(contexts, chunks)
    num_prompt = out.num_batched_tokens - out.num_decodes
    target.observe(out.num_decodes, num_prompt, seconds, sum(contexts))
    return seconds


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    quiet_logging()
    tokenizer, _ = load_tokenizer()
    slos: list[Slo] = args.slo
    runs: dict[str, Any] = {}
    for seed in args.seeds:
        points = []
        for rate in args.rates:
            plan = plan_rate(rate, args.duration, seed, args.tenants, args.max_tokens)
            ttft_s = args.target_ttft_ms / 1000
            records = replay(plan, tokenizer, args.machine, args.calibration, ttft_s, seed)
            points.append(rate_point(plan, records, slos))
        runs[str(seed)] = {"rates": points, "goodput": goodput(points, slos, 0.9)}
    mean = {
        slo.name: [
            statistics.mean(runs[str(s)]["rates"][i]["attainment"][slo.name] for s in args.seeds)
            for i in range(len(args.rates))
        ]
        for slo in slos
    }
    report: dict[str, Any] = {
        "machine": asdict(args.machine),
        "calibration": asdict(args.calibration),
        "target_ttft_ms": args.target_ttft_ms,
        "rates": args.rates,
        "seeds": runs,
        "mean_attainment": mean,
    }
    series = {f"mean {name}": (args.rates, values) for name, values in mean.items()}
    title = "realistic chat replayed on a virtual clock: requests meeting the SLO"
    path = args.out_dir / "schedule_replay.png"
    report["plots"] = [
        str(curves(series, title, "requests/s", "fraction", path, 0.9, True, (0, 1.02)))
    ]
    emit(report, args.out_dir, "schedule_replay")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
