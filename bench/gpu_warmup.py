"""Compile FlashInfer's modules before the tests with ``atrium kernels build`` (the serve stage's
shape first, each module timed), check that the serve stage's engine will compile nothing, then
plan and run one tiny mixed step and one decode-only step per head configuration. ``--dry-run``
lists the modules and stops before the first CUDA call.

``python -m bench.gpu_warmup --out warmup.json [--prefill-kernel fa2] [--dry-run]``
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from bench.gpu_modules import HEAD_CONFIGS, HEAD_DIM, PREFILL_KERNELS_ON_SM90, describe
from engine.attention.flashinfer_backend import FlashInferAttentionBackend
from engine.attention.metadata import SeqSlice, build_attention_metadata

PAGE = 16
SERVE_HEADS = HEAD_CONFIGS[0]  # the serve stage's SmolLM2 shape: 9/3 heads of 64


def kernels_build(heads: tuple[int, int], prefill_kernel: str, *flags: str) -> dict[str, Any]:
    """``atrium kernels build`` for bf16 heads of 64 on this machine's GPU (or, in the dry run,
    on FLASHINFER_CUDA_ARCH_LIST): its JSON report; a failure ends the warm-up with its reason."""
    cmd = [sys.executable, "-m", "web.cli", "--log-level", "warning", "kernels", "build",
           "--heads", f"{heads[0]}/{heads[1]}", "--head-dim", str(HEAD_DIM),
           "--dtype", "bfloat16", "--prefill-kernel", prefill_kernel, "--json", *flags]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[2:])}: exit {done.returncode}\n{done.stderr[-3000:]}")
    report: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return report


def compile_modules(prefill_kernel: str) -> list[dict[str, Any]]:
    """Every head configuration's modules, the serve stage's first (nvcc and ninja only, no
    GPU; a configuration's modules compile in parallel), each compiled one timed."""
    rows = []
    for heads in HEAD_CONFIGS:
        built = kernels_build(heads, prefill_kernel)["modules"]
        rows += [{"module": m["name"], "compile_s": m["compile_s"]} for m in built
                 if m["compile_s"]]  # fmt: skip
    return rows


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
    if args.dry_run:  # the command's listing, on CPU: nothing is compiled
        listed = kernels_build(SERVE_HEADS, args.prefill_kernel, "--dry-run")
        report["serve_kernels"] = listed["modules"]
        print(f"  atrium kernels build lists {len(listed['modules'])} modules for the serve stage")
    else:
        report["modules"] = compile_modules(args.prefill_kernel)
        for row in report["modules"]:
            print(f"  compiled in {row['compile_s']:>6} s  {row['module']}")
        # The serve stage's engine must find every module it loads: none compiles at its start.
        report["serve_kernels"] = kernels_build(SERVE_HEADS, args.prefill_kernel, "--check")[
            "modules"
        ]
        report["steps"] = run_steps(args.prefill_kernel, torch.device("cuda", 0))
        for row in report["steps"]:
            print(f"  {row['heads']} {row['step']:<6} step (load, plan, run) {row['seconds']} s")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
