"""Compile FlashInfer's modules before the tests, each timed, then plan and run one tiny mixed step
and one decode-only step per head configuration. ``--dry-run`` stops before the first CUDA call.

``python -m bench.gpu_warmup --out warmup.json [--prefill-kernel fa2] [--dry-run]``
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from bench.gpu_modules import PREFILL_KERNELS_ON_SM90, describe, module_specs
from engine.attention.flashinfer_backend import FlashInferAttentionBackend
from engine.attention.metadata import SeqSlice, build_attention_metadata

PAGE = 16
# (query heads, KV heads): a group of 4 decodes on tensor cores (FA2's prefill kernel); the
# default model's 9/3 uses the plain decode kernel.
HEAD_CONFIGS = ((8, 2), (9, 3))


def compile_modules(prefill_kernel: str) -> list[dict[str, Any]]:
    """Build every module at once (nvcc and ninja only, no GPU), each timed on its own."""

    def build(spec: Any) -> dict[str, Any]:
        start = time.perf_counter()
        spec.build(need_lock=True)
        return {"module": spec.name, "compile_s": round(time.perf_counter() - start, 1)}

    specs = module_specs(prefill_kernel)
    with ThreadPoolExecutor(max_workers=len(specs)) as pool:
        return list(pool.map(build, specs))


def run_steps(prefill_kernel: str, device: torch.device) -> list[dict[str, Any]]:
    """Plan and run a mixed step and a decode-only step per head configuration, timed."""
    steps = {
        "mixed": [SeqSlice([0, 1, 2], 20, 17), SeqSlice([3], 0, 9), SeqSlice([4, 5], 30, 1)],
        "decode": [SeqSlice([0, 1, 2], 40, 1), SeqSlice([4, 5], 30, 1)],
    }
    rows = []
    for hq, hkv in HEAD_CONFIGS:
        backend = FlashInferAttentionBackend(
            hq, hkv, 64, PAGE, torch.bfloat16, device, num_pages=8, prefill_kernel=prefill_kernel
        )
        cache = torch.zeros(8, 2, PAGE, hkv, 64, dtype=torch.bfloat16, device=device)
        for name, seqs in steps.items():
            n = sum(s.num_new_tokens for s in seqs)
            q = torch.randn(n, hq, 64, device=device, dtype=torch.bfloat16)
            kv = torch.randn(n, hkv, 64, device=device, dtype=torch.bfloat16)
            start = time.perf_counter()
            backend.plan(build_attention_metadata(seqs, PAGE, device))
            out = backend.forward(0, q, kv, kv, cache)
            torch.cuda.synchronize(device)
            if not torch.isfinite(out.float()).all():
                raise RuntimeError(f"{name} step with {hq}/{hkv} heads gave non-finite outputs")
            elapsed = round(time.perf_counter() - start, 2)
            rows.append({"heads": f"{hq}/{hkv}", "step": name, "seconds": elapsed})
    return rows


def dry_run(prefill_kernel: str, manifest: Path | None) -> dict[str, Any]:
    """Generate every module's sources and check the installed package holds all they include."""
    found = describe(prefill_kernel)
    if manifest is not None:
        system = set(json.loads(manifest.read_text(encoding="utf-8"))["system_includes"])
        lost = sorted(set(found["unresolved_includes"]) - system)
        if lost:
            raise SystemExit(f"headers missing from the installed FlashInfer: {lost}")
    return {"modules": found["modules"], "data_files": len(found["data_files"])}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_warmup", description=__doc__)
    parser.add_argument("--prefill-kernel", default="auto", choices=sorted(PREFILL_KERNELS_ON_SM90))
    parser.add_argument("--out", type=Path, required=True, help="the JSON report")
    parser.add_argument("--manifest", type=Path, default=None, help="the bundle's manifest.json")
    parser.add_argument("--dry-run", action="store_true", help="CPU: generate and check sources")
    args = parser.parse_args(argv)
    report: dict[str, Any] = {"prefill_kernel": args.prefill_kernel}
    report["sources"] = dry_run(args.prefill_kernel, args.manifest)
    print(f"  sources of {len(report['sources']['modules'])} modules present")
    if not args.dry_run:
        report["modules"] = compile_modules(args.prefill_kernel)
        for row in report["modules"]:
            print(f"  compiled in {row['compile_s']:>6} s  {row['module']}")
        report["steps"] = run_steps(args.prefill_kernel, torch.device("cuda", 0))
        for row in report["steps"]:
            print(f"  {row['heads']} {row['step']:<6} step (load, plan, run) {row['seconds']} s")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
