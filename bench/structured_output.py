"""The step-time cost of structured output: decode steps with and without a JSON schema.

python -m bench.structured_output [--batches 1 32] [--tokens 64] [--repeats 3]

Each trial prefills a batch (untimed), then times ``--tokens`` decode steps with every request
still running, sampled at temperature 0.7 without drafts: the plain arm with ``ignore_eos``, the
schema arm under a schema whose shortest answer is longer than the timed steps (an array with
many required items), so no request ends inside them. ``max_tokens`` is four times the timed
steps, so this is the steady state (masks filled beside the forward pass and applied, the way
out re-planned every few steps), not the last tokens where the way out is planned each step.
The arms alternate; medians are kept. Goal: under 10% added step time at batch 32.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import DEFAULT_OUT_DIR, emit, quiet_logging, ratio
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model.loader import load_model
from engine.outputs import GenerateRequest
from engine.sampling_params import SamplingParams
from engine.structured.spec import GrammarSpec
from radix_cache.radix_prefix_cache import RadixPrefixCache

GOAL_ADDED_B32 = 0.10
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "notes": {
            "type": "array",
            "items": {"type": "string", "maxLength": 24},
            "minItems": 24,
        },
    },
    "required": ["title", "notes"],
    "additionalProperties": False,
}
PROMPT = "Write a list of short notes about the history of Paris, as JSON."


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--tokens", type=int, default=64, help="decode tokens per request")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR)
    return parser.parse_args(argv)


def run_arm(
    engine: LLMEngine, prompt: list[int], batch: int, tokens: int, grammar: GrammarSpec | None
) -> dict[str, float]:
    """``tokens`` decode steps of one batch: the steps' seconds and split."""
    tag = f"{'s' if grammar else 'p'}{time.perf_counter_ns()}"
    for i in range(batch):
        params = SamplingParams(
            max_tokens=4 * tokens + 1, temperature=0.7, seed=i, ignore_eos=grammar is None,
            grammar=grammar,
        )  # fmt: skip
        engine.add_request(GenerateRequest(f"{tag}-{i}", prompt, params))
    started: set[str] = set()
    while len(started) < batch:  # prefill and first tokens: untimed
        started.update(out.request_id for out in engine.step() if out.token_ids)
    before = engine.stats.copy()
    generated = 0
    start = time.perf_counter()
    for _ in range(tokens):
        outputs = engine.step()
        generated += sum(len(out.token_ids) for out in outputs)
        if any(out.finished for out in outputs):
            raise RuntimeError("a request ended inside the timed steps: the arms would differ")
    seconds = time.perf_counter() - start
    after = engine.stats.copy()
    steps = after.num_steps - before.num_steps
    engine.abort_all()
    while engine.has_unfinished:
        engine.step()
    return {
        "steps": steps,
        "tokens": generated,
        "step_ms": 1000 * ratio(seconds, steps),
        "sample_ms_per_step": 1000 * ratio(after.sample_s - before.sample_s, steps),
        "forward_ms_per_step": 1000 * ratio(after.forward_s - before.forward_s, steps),
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    quiet_logging()
    loaded = load_model(args.model, dtype=getattr(torch, args.dtype))
    config = EngineConfig(
        dtype=args.dtype,
        speculative_tokens=0,
        max_num_seqs=max(args.batches),
        max_num_batched_tokens=max(512, 64 * max(args.batches)),
    )
    engine = LLMEngine(loaded, config, prefix_cache_factory=RadixPrefixCache)
    prompt = loaded.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}])
    spec = GrammarSpec.json_schema(SCHEMA)
    t0 = time.perf_counter()
    run_arm(engine, prompt, 1, 2, spec)  # warm-up: compiles the schema, loads xgrammar
    first_compile_s = time.perf_counter() - t0
    results: dict[str, Any] = {}
    for batch in args.batches:
        trials: dict[str, list[dict[str, float]]] = {"plain": [], "schema": []}
        for _ in range(args.repeats):
            trials["plain"].append(run_arm(engine, prompt, batch, args.tokens, None))
            trials["schema"].append(run_arm(engine, prompt, batch, args.tokens, spec))
        medians = {
            arm: {key: statistics.median(t[key] for t in runs) for key in runs[0]}
            for arm, runs in trials.items()
        }
        plain, schema = medians["plain"]["step_ms"], medians["schema"]["step_ms"]
        results[f"batch_{batch}"] = {
            **{f"{arm}_{k}": v for arm, m in medians.items() for k, v in m.items()},
            "added_step_share": ratio(schema - plain, plain),
        }
    added_b32 = results.get("batch_32", {}).get("added_step_share")
    emit(
        {
            "bench": "structured_output",
            "machine": {
                "cpu": platform.processor() or platform.machine(),
                "threads": torch.get_num_threads(),
            },
            "model": args.model,
            "dtype": args.dtype,
            "tokens_per_request": args.tokens,
            "repeats": args.repeats,
            "warmup_with_first_compile_s": first_compile_s,
            "results": results,
            "goal": {"added_step_share_b32_below": GOAL_ADDED_B32, "met": None
                     if added_b32 is None else added_b32 < GOAL_ADDED_B32},
        },
        args.out_dir,
        "structured_output",
    )  # fmt: skip


if __name__ == "__main__":
    main()
