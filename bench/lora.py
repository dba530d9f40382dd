"""Decode throughput with LoRA adapters: batch 32 with 0, 1, 4 and 16 distinct adapters.

python -m bench.lora [--adapters 0 1 4 16] [--batch 32] [--rank 16] [--targets ...] [--repeats 3]

Random rank-``--rank`` adapters on ``--targets`` (default every projection: q, k, v, o, gate, up,
down; PEFT's own default for Llama models is ``q_proj v_proj``) are written in PEFT's format to a
temporary folder; ``--batch`` requests take them in turn (0: the base model
alone). Each trial prefills the batch (untimed), then times ``--tokens`` decode steps with every
request running, greedy without drafts; the median over repeats is kept. The engine holds as
many slots as the largest arm needs, so no arm reloads adapters. Goal: 16 adapters cost under
25% of the no-adapter throughput.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from bench.common import DEFAULT_OUT_DIR, emit, quiet_logging, ratio
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.lora.adapter import TARGETS, target_shape
from engine.model.config import ModelConfig
from engine.model.loader import load_model
from engine.outputs import GenerateRequest
from engine.sampling_params import SamplingParams
from radix_cache.radix_prefix_cache import RadixPrefixCache

GOAL_COST_16 = 0.25
PROMPT = "Tell me a long story about a lighthouse keeper and the sea."


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--adapters", type=int, nargs="+", default=[0, 1, 4, 16])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--targets", nargs="+", default=list(TARGETS), choices=TARGETS)
    parser.add_argument("--tokens", type=int, default=32, help="timed decode steps per trial")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR)
    return parser.parse_args(argv)


def write_adapter(
    folder: Path, config: ModelConfig, rank: int, seed: int, targets: Sequence[str] = TARGETS
) -> Path:
    """A random PEFT-format adapter of ``config``'s model on ``targets``."""
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(config.num_layers):
        for target in targets:
            in_features, out_features = target_shape(config, target)
            part = "self_attn" if target in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{target}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_features, generator=gen) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_features, rank, generator=gen) * 0.02
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    adapter_config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": list(targets),
    }
    (folder / "adapter_config.json").write_text(json.dumps(adapter_config))
    return folder


def run_arm(
    engine: LLMEngine, prompt: list[int], batch: int, tokens: int, adapters: list[Path]
) -> dict[str, float]:
    """``tokens`` decode steps of ``batch`` requests spread over ``adapters`` (none: base)."""
    tag = f"a{len(adapters)}-{time.perf_counter_ns()}"
    params = SamplingParams(max_tokens=4 * tokens + 1, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        path = adapters[i % len(adapters)] if adapters else None
        name = None if path is None else path.name
        request = GenerateRequest(
            f"{tag}-{i}",
            prompt,
            params,
            lora_name=name,
            lora_path=None if path is None else str(path),
        )
        engine.add_request(request)
    started: set[str] = set()
    while len(started) < batch:  # prefill and first tokens: untimed
        started.update(out.request_id for out in engine.step() if out.token_ids)
    generated = 0
    start = time.perf_counter()
    for _ in range(tokens):
        generated += sum(len(out.token_ids) for out in engine.step())
    seconds = time.perf_counter() - start
    engine.abort_all()
    while engine.has_unfinished:
        engine.step()
    return {"tokens": generated, "seconds": seconds, "tok_s": ratio(generated, seconds)}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    quiet_logging()
    loaded = load_model(args.model, dtype=getattr(torch, args.dtype))
    config = EngineConfig(
        dtype=args.dtype,
        speculative_tokens=0,
        max_num_seqs=args.batch,
        max_num_batched_tokens=max(512, 64 * args.batch),
        max_loras=max(1, *args.adapters),
        max_lora_rank=args.rank,
    )
    engine = LLMEngine(loaded, config, prefix_cache_factory=RadixPrefixCache)
    prompt = loaded.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}])
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        paths = [
            write_adapter(Path(tmp) / f"bench-lora-{i}", loaded.config, args.rank, i, args.targets)
            for i in range(max(args.adapters))
        ]
        run_arm(engine, prompt, min(args.batch, 2), 2, paths[:1])  # warm-up: loads a slot
        for count in args.adapters:
            trials = [
                run_arm(engine, prompt, args.batch, args.tokens, paths[:count])
                for _ in range(args.repeats)
            ]
            results[f"adapters_{count}"] = {
                "tok_s": statistics.median(t["tok_s"] for t in trials),
                "trials_tok_s": [t["tok_s"] for t in trials],
            }
    base = results.get("adapters_0", {}).get("tok_s")
    for value in results.values():
        value["cost_vs_base"] = None if not base else 1 - ratio(value["tok_s"], base)
    cost_16 = results.get("adapters_16", {}).get("cost_vs_base")
    emit(
        {
            "bench": "lora",
            "machine": {
                "cpu": platform.processor() or platform.machine(),
                "threads": torch.get_num_threads(),
            },
            "model": args.model,
            "dtype": args.dtype,
            "batch": args.batch,
            "rank": args.rank,
            "targets": args.targets,
            "adapter_params_over_base": ratio(
                sum(sum(target_shape(loaded.config, t)) * args.rank for t in args.targets)
                * loaded.config.num_layers,
                sum(p.numel() for p in loaded.model.parameters()),
            ),
            "tokens_per_trial": args.tokens,
            "repeats": args.repeats,
            "results": results,
            "goal": {
                "cost_16_below": GOAL_COST_16,
                "met": None if cost_16 is None else cost_16 < GOAL_COST_16,
            },
        },
        args.out_dir,
        "lora",
    )


if __name__ == "__main__":
    main()
