"""Offline engine throughput beside transformers on the same bf16 weights: prefill, decode, split.

python -m bench.engine_throughput [--batches 1 8 32 64] [--decode-tokens 16]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench import hf_reference as hf
from bench.common import DEFAULT_OUT_DIR, emit, quiet_logging, ratio
from bench.engine_runs import (
    PhaseResult,
    random_prompts,
    run_decode,
    run_prefill,
    split_shares,
)
from bench.plots import bar_compare
from bench.profiling import profile_decode_steps
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model.export import export_hf
from engine.model.loader import load_model

TARGETS = {"decode_b32_ratio": 1.0, "prefill_ratio": 0.9, "sched_meta_share_b32": 0.10}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--prompt-len", type=int, default=64, help="decode runs' prompt length")
    parser.add_argument("--decode-tokens", type=int, default=16)
    parser.add_argument("--prefill-len", type=int, default=512)
    parser.add_argument("--prefill-prompts", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3, help="alternating trials; medians")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--profile", action="store_true", help="torch.profiler at batch 32")
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR)
    return parser.parse_args(argv)


def median_run(runs: list[PhaseResult]) -> PhaseResult:
    """The trial with the median throughput (its split goes with it)."""
    return sorted(runs, key=lambda r: r.tok_s)[len(runs) // 2]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    quiet_logging()
    if args.threads > 0:
        torch.set_num_threads(args.threads)

    loaded = load_model(args.model, dtype=torch.bfloat16)
    max_batch = max(args.batches)
    config = EngineConfig(max_num_seqs=max(64, max_batch), enable_prefix_cache=False)
    engine = LLMEngine(loaded, config)
    with tempfile.TemporaryDirectory() as tmp:
        export_hf(loaded, Path(tmp))
        reference = hf.load_reference(Path(tmp), torch.bfloat16)
    warm = random_prompts(1, 32, seed=99)
    run_decode(engine, warm, 2, "warm")
    hf.warm_up(reference, warm[0])

    started = time.perf_counter()
    prefill_prompts = random_prompts(args.prefill_prompts, args.prefill_len, seed=1)
    ours_runs, theirs_runs = [], []
    for trial in range(args.repeats):  # alternate the two systems so noise hits both
        ours_runs.append(run_prefill(engine, prefill_prompts, f"prefill{trial}"))
        theirs_runs.append(hf.reference_prefill(reference, prefill_prompts))
    ours = median_run(ours_runs)
    theirs = statistics.median(theirs_runs)
    prefill = {
        "prompt_len": args.prefill_len,
        "atrium_tok_s": ours.tok_s,
        "transformers_tok_s": theirs,
        "ratio": ratio(ours.tok_s, theirs),
        "atrium_trials": [r.tok_s for r in ours_runs],
        "transformers_trials": theirs_runs,
        "atrium_split": split_shares(ours.split, ours.seconds),
    }

    decode: list[dict[str, Any]] = []
    for batch in args.batches:
        prompts = random_prompts(batch, args.prompt_len, seed=batch)
        ours_runs, theirs_runs = [], []
        for trial in range(args.repeats):
            ours_runs.append(run_decode(engine, prompts, args.decode_tokens, f"d{batch}-{trial}"))
            theirs_runs.append(hf.reference_decode(reference, prompts, args.decode_tokens))
        ours = median_run(ours_runs)
        theirs = statistics.median(theirs_runs)
        decode.append(
            {
                "batch": batch,
                "atrium_tok_s": ours.tok_s,
                "transformers_tok_s": theirs,
                "ratio": ratio(ours.tok_s, theirs),
                "atrium_trials": [r.tok_s for r in ours_runs],
                "transformers_trials": theirs_runs,
                "atrium_step_ms": 1e3 * ours.seconds / max(ours.num_steps, 1),
                "atrium_split": split_shares(ours.split, ours.seconds),
            }
        )

    result: dict[str, Any] = {
        "model": loaded.name,
        "dtype": "bfloat16",
        "torch_threads": torch.get_num_threads(),
        "repeats": args.repeats,
        "decode_prompt_len": args.prompt_len,
        "decode_tokens": args.decode_tokens,
        "prefill": prefill,
        "decode": decode,
        "targets": TARGETS,
        "seconds": time.perf_counter() - started,
    }
    by_batch = {row["batch"]: row for row in decode}
    if 32 in by_batch:
        split = by_batch[32]["atrium_split"]
        result["checks"] = {
            "decode_b32_ratio": by_batch[32]["ratio"],
            "prefill_ratio": prefill["ratio"],
            "sched_meta_share_b32": split["schedule"] + split["metadata"],
        }
    if args.profile:
        prompts = random_prompts(32, args.prompt_len, seed=32)
        result["profile_b32"] = profile_decode_steps(engine, prompts, num_steps=4)
    result["plot"] = str(
        bar_compare(
            [str(row["batch"]) for row in decode],
            {
                "atrium": [row["atrium_tok_s"] for row in decode],
                "transformers": [row["transformers_tok_s"] for row in decode],
            },
            "decode tok/s by batch size (bf16, same weights)",
            "batch",
            "tokens/s",
            args.out_dir / "engine_decode.png",
        )
    )
    emit(result, args.out_dir, "engine_throughput")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
