"""Where a decode step's time goes at batch 32 and 64 over ~1k-token contexts with shared
prefixes, beside the floor this machine's measured GEMM peak and read bandwidth allow (JSON).

``python -m bench.decode_profile`` loads the default model, prefills ``--batch`` requests (groups
sharing a ``--prefix-len`` prefix, each with ``--suffix-len`` tokens of its own), then alternates
plain decode steps (timed by the engine's own counters) with instrumented ones (every projection,
attention, norm/RoPE and activation call timed). Shares of the step are the figures to read on a
shared machine; absolute times move with its load.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from bench.common import DEFAULT_OUT_DIR, emit, quiet_logging
from bench.engine_runs import STEP_PARTS
from engine.config import EngineConfig
from engine.device import dtype_name, resolve_dtype
from engine.llm_engine import LLMEngine
from engine.model import llama, mlp
from engine.model.loader import load_model
from engine.outputs import GenerateRequest
from engine.sampling_params import SamplingParams
from radix_cache import RadixPrefixCache

FORWARD_PARTS = ("projections", "lm_head", "attention", "attention_plan", "norm_rope", "activation")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    add = parser.add_argument
    add("--model", default="default")
    add("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    add("--batch", type=int, nargs="+", default=[32, 64])
    add("--groups", type=int, default=4, help="shared prefixes (requests split evenly)")
    add("--prefix-len", type=int, default=768)
    add("--suffix-len", type=int, default=256)
    add("--steps", type=int, default=12, help="plain and instrumented steps, each")
    add("--speculative-tokens", type=int, default=0, help="drafts per decode (default: off)")
    add("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    add("--out-dir", type=Path, default=DEFAULT_OUT_DIR)
    return parser.parse_args(argv)


def measure_peaks(dtype: torch.dtype, repeats: int = 5) -> dict[str, float]:
    """Best of ``repeats``: a 2048^3 matmul in ``dtype`` (GFLOP/s) and a sum over 256 MiB of
    float32 (GB/s read)."""
    a = torch.randn(2048, 2048).to(dtype)
    b = torch.randn(2048, 2048).to(dtype)
    big = torch.ones(64 * 2**20)
    gemm_s, read_s = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.matmul(a, b)
        t1 = time.perf_counter()
        big.sum()
        t2 = time.perf_counter()
        gemm_s.append(t1 - t0)
        read_s.append(t2 - t1)
    return {
        "gemm_gflops": 2 * 2048**3 / min(gemm_s) / 1e9,
        "read_gbs": big.nbytes / min(read_s) / 1e9,
    }


class PartTimer:
    """Wall time and calls per part of the forward, while ``installed``."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def _wrap(self, fn: Callable[..., Any], part: Callable[..., str]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                name = part(*args, **kwargs)
                self.seconds[name] += time.perf_counter() - start
                self.calls[name] += 1

        return timed

    @contextmanager
    def installed(self) -> Iterator[None]:
        output_weight = self.engine.runner.model.output_weight

        def projection(x: torch.Tensor, weight: torch.Tensor, *_: Any, **__: Any) -> str:
            return "lm_head" if weight is output_weight else "projections"

        patched: list[tuple[Any, str, Any]] = []

        def patch(owner: Any, name: str, part: Callable[..., str], instance: bool = False) -> None:
            original = getattr(owner, name)
            patched.append((owner, name, None if instance else original))
            setattr(owner, name, self._wrap(original, part))

        for module in (llama, mlp):
            patch(module, "project", projection)
            patch(module, "project_add", projection)
        patch(mlp, "silu", lambda *a, **k: "activation")
        backend = self.engine.runner.backend
        for name, part in (("forward", "attention"), ("forward_layer", "attention"),
                           ("plan", "attention_plan")):  # fmt: skip
            patch(backend, name, lambda *a, _p=part, **k: _p, instance=True)
        native = self.engine.runner.model.norm.native
        if native is not None:
            patch(native, "rms_norm", lambda *a, **k: "norm_rope", instance=True)
            patch(native, "rope", lambda *a, **k: "norm_rope", instance=True)
        else:
            patch(llama, "rope_inplace", lambda *a, **k: "norm_rope")
        try:
            yield
        finally:
            for owner, name, original in reversed(patched):
                if original is None:
                    delattr(owner, name)  # the instance attribute shadowed the class's method
                else:
                    setattr(owner, name, original)


def shared_prefix_prompts(
    batch: int, groups: int, prefix_len: int, suffix_len: int, seed: int, vocab: int
) -> list[list[int]]:
    """``batch`` prompts in ``groups`` sharing a prefix, each with ``suffix_len`` of its own."""
    rng = random.Random(seed)
    low, high = min(100, vocab // 2), min(20000, vocab)
    prefixes = [[rng.randrange(low, high) for _ in range(prefix_len)] for _ in range(groups)]
    return [
        prefixes[i % groups] + [rng.randrange(low, high) for _ in range(suffix_len)]
        for i in range(batch)
    ]


def decode_floor(
    engine: LLMEngine,
    batch: int,
    groups: int,
    prefix_len: int,
    private_len: int,
    peaks: dict[str, float],
) -> dict[str, float]:
    """The least a decode step of ``batch`` rows can take here: the weights' products at the
    GEMM peak (or their bytes at the read bandwidth, whichever is longer), plus attention's K/V
    bytes (each shared prefix read once per step) or its products, whichever is longer."""
    model = engine.runner.model
    projections = ("qkv_proj.weight", "o_proj.weight", "gate_up_proj.weight", "down_proj.weight")
    weights = [model.output_weight]
    weights += [p for name, p in model.named_parameters() if name.endswith(projections)]
    numel = sum(w.numel() for w in weights)
    weight_bytes = sum(w.numel() * w.element_size() for w in weights)
    gflops, gbs = peaks["gemm_gflops"] * 1e9, peaks["read_gbs"] * 1e9
    gemm_s = max(2 * batch * numel / gflops, weight_bytes / gbs)
    config = model.config
    element = weights[0].element_size()
    kv_tokens = groups * prefix_len + batch * private_len
    kv_bytes = config.num_layers * kv_tokens * 2 * config.num_kv_heads * config.head_dim * element
    context = prefix_len + private_len
    attn_flops = 4 * batch * context * config.num_heads * config.head_dim * config.num_layers
    attention_s = max(kv_bytes / gbs, attn_flops / gflops)
    return {
        "gemm_ms": 1e3 * gemm_s,
        "gemm_gflop": 2 * batch * numel / 1e9,
        "weight_mb": weight_bytes / 1e6,
        "attention_ms": 1e3 * attention_s,
        "kv_mb": kv_bytes / 1e6,
        "floor_ms": 1e3 * (gemm_s + attention_s),
    }


def dispatched_ops(engine: LLMEngine) -> int:
    """torch operators called from Python in one step (not counting those they call)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.step()
    return sum(1 for event in prof.events() if event.cpu_parent is None)


def profile_batch(
    engine: LLMEngine, args: argparse.Namespace, batch: int, peaks: dict[str, float]
) -> dict[str, Any]:
    prompts = shared_prefix_prompts(
        batch, args.groups, args.prefix_len, args.suffix_len, batch, engine.vocab_size
    )
    params = SamplingParams(max_tokens=2 * args.steps + 8, temperature=0.0, ignore_eos=True)
    ids = [f"b{batch}-{i}" for i in range(batch)]
    for request_id, prompt in zip(ids, prompts, strict=True):
        engine.add_request(GenerateRequest(request_id, prompt, params))
    started: set[str] = set()
    while started != set(ids):  # prefill, untimed
        started.update(out.request_id for out in engine.step() if out.token_ids)
    engine.step()  # one decode step to warm
    # Peaks again beside this batch's steps: the best seen is the floor's (a busy minute
    # lowers them, and would flatter the ratios).
    for name, value in measure_peaks(engine.runner.model.output_weight.dtype).items():
        peaks[name] = max(peaks[name], value)
    ops = dispatched_ops(engine)
    timer = PartTimer(engine)
    plain_s: list[float] = []
    timed_s: list[float] = []
    cpu_s = 0.0
    counters: dict[str, float] = defaultdict(float)
    timed_forward = 0.0  # the forward's time within the timed steps, which hold the parts
    for _ in range(args.steps):
        before = engine.stats.copy()
        cpu0, t0 = time.process_time(), time.perf_counter()
        engine.step()
        plain_s.append(time.perf_counter() - t0)
        cpu_s += time.process_time() - cpu0
        for part in STEP_PARTS:
            counters[part] += getattr(engine.stats, part) - getattr(before, part)
        before = engine.stats.copy()
        with timer.installed():
            t0 = time.perf_counter()
            engine.step()
            timed_s.append(time.perf_counter() - t0)
        timed_forward += engine.stats.forward_s - before.forward_s
    for request_id in ids:
        engine.abort(request_id)
    engine.step()
    wall, timed_wall = sum(plain_s), sum(timed_s)
    step_share = {part.removesuffix("_s"): counters[part] / wall for part in STEP_PARTS}
    step_share["outside_counters"] = max(0.0, 1.0 - sum(step_share.values()))
    forward_share = {part: timer.seconds[part] / timed_wall for part in FORWARD_PARTS}
    # The parts against the forward of the same timed steps: shares of two separate runs of a
    # few steps differ by whatever else the machine did meanwhile.
    timed_forward_share = timed_forward / timed_wall
    forward_share["rest_of_forward"] = max(0.0, timed_forward_share - sum(forward_share.values()))
    step_ms = 1e3 * statistics.median(plain_s)
    floor = decode_floor(
        engine, batch, args.groups, args.prefix_len, args.suffix_len + args.steps + 2, peaks
    )
    gemm_ms = step_ms * (forward_share["projections"] + forward_share["lm_head"])
    attention_ms = step_ms * forward_share["attention"]
    return {
        "batch": batch,
        "context_tokens": args.prefix_len + args.suffix_len,
        "step_ms": step_ms,
        "step_ms_instrumented": 1e3 * statistics.median(timed_s),
        "cpu_busy_threads": cpu_s / wall,
        "step_share": step_share,
        "forward_share": forward_share,
        "timed_forward_share": timed_forward_share,
        "scheduler_cache_postprocess_share": step_share["schedule"]
        + step_share["metadata"]
        + step_share["postprocess"]
        + step_share["outside_counters"],
        "calls_per_step": {k: v / args.steps for k, v in sorted(timer.calls.items())},
        "torch_ops_dispatched_per_step": ops,
        "floor": floor,
        "step_over_floor": step_ms / floor["floor_ms"],
        "gemm_over_floor": gemm_ms / floor["gemm_ms"],
        "attention_over_floor": attention_ms / floor["attention_ms"],
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    quiet_logging()
    if args.threads > 0:
        torch.set_num_threads(args.threads)

    dtype = resolve_dtype(args.dtype, torch.device("cpu"))
    loaded = load_model(args.model, dtype=dtype)
    peaks = measure_peaks(dtype)
    largest = max(args.batch)
    pages_per_request = -(-(args.prefix_len + args.suffix_len + 2 * args.steps + 16) // 16)
    config = EngineConfig(
        num_pages=largest * pages_per_request + 64,
        max_num_seqs=largest,
        speculative_tokens=args.speculative_tokens,
        dtype=dtype_name(dtype),
    )
    engine = LLMEngine(loaded, config, prefix_cache_factory=RadixPrefixCache)
    started = time.perf_counter()
    runs = [profile_batch(engine, args, batch, peaks) for batch in args.batch]
    result = {
        "model": loaded.name,
        "dtype": dtype_name(dtype),
        "torch_threads": torch.get_num_threads(),
        "load_average": os.getloadavg(),
        "groups": args.groups,
        "prefix_len": args.prefix_len,
        "suffix_len": args.suffix_len,
        "speculative_tokens": args.speculative_tokens,
        "peaks": peaks,
        "runs": runs,
        "seconds": time.perf_counter() - started,
    }
    emit(result, args.out_dir, "decode_profile")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
