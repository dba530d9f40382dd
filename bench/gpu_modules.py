"""The FlashInfer JIT modules Atrium's attention compiles, and the package files they need.

Run as ``python -m bench.gpu_modules`` (FlashInfer importable, no GPU needed) it prints JSON: each
module's name and sources, every package file read to generate them, and the ``#include`` closure.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from engine.attention.flashinfer_kernels import module_specs as engine_module_specs
from engine.attention.kernel_plan import KernelShape, planned_modules

HEAD_DIM = 64  # the default model's, the GPU tests' and the bench's
# (query heads, KV heads): a group of 4 decodes on tensor cores (FA2's prefill kernel); the
# default model's 9/3 uses the plain decode kernel.
HEAD_CONFIGS = ((9, 3), (8, 2))
PREFILL_KERNELS_ON_SM90 = {"auto": "fa3", "fa2": "fa2", "fa3": "fa3"}
_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*([<"])([^>"]+)[>"]', re.MULTILINE)
# The header trees FlashInfer's JIT puts on the include path, kept whole in the bundle
# (relative to the package's data/); csrc/ is pruned to what the modules below reach.
HEADER_TREES = (
    "include",
    "cccl/cub",
    "cccl/libcudacxx/include",
    "cccl/thrust",
    "cutlass/include",
    "cutlass/tools/util/include",
    "spdlog/include",
)


def module_specs(prefill_kernel: str) -> list[Any]:
    """The JIT specs of bf16, head_dim 64 engines on sm90 for every head configuration the check
    runs, each once: the engine's own plan (``engine/attention/kernel_plan.py``), so the bundle,
    the warm-up and ``atrium kernels build`` name the same modules."""
    specs: dict[str, Any] = {}
    for hq, hkv in HEAD_CONFIGS:
        shape = KernelShape(hq, hkv, HEAD_DIM, torch.bfloat16, prefill_kernel)
        for spec in engine_module_specs(shape, planned_modules(shape, (9,))):
            specs.setdefault(spec.name, spec)
    return list(specs.values())


def include_dirs(data: Path) -> list[Path]:
    """FlashInfer's include path in its order (CCCL first: it overrides the CUDA toolkit's)."""
    import tvm_ffi  # type: ignore[import-not-found]

    tvm = [
        Path(tvm_ffi.libinfo.find_include_path()),
        Path(tvm_ffi.libinfo.find_dlpack_include_path()),
    ]
    cccl = [data / t for t in HEADER_TREES if t.startswith("cccl/")]
    rest = [data / t for t in HEADER_TREES if not t.startswith("cccl/")]
    return [*cccl, *tvm, rest[0], data / "csrc", *rest[1:]]


def include_closure(sources: Iterable[Path], dirs: Sequence[Path]) -> tuple[set[Path], set[str]]:
    """Every file the sources include, transitively, resolved as the compiler would (``#if``
    ignored, so a superset); and the names found nowhere (CUDA and C++ system headers)."""
    reached: set[Path] = set()
    unresolved: set[str] = set()
    todo = [Path(s) for s in sources]
    while todo:
        path = todo.pop()
        if path in reached:
            continue
        reached.add(path)
        for quote, name in _INCLUDE.findall(path.read_text(encoding="utf-8", errors="replace")):
            here = [path.parent] if quote == '"' else []
            found = next((d / name for d in [*here, *dirs] if (d / name).is_file()), None)
            if found is None:
                unresolved.add(name)
            else:
                todo.append(found.resolve())
    return reached, unresolved


def describe(prefill_kernel: str) -> dict[str, Any]:
    """Generate the modules' sources (CPU only), recording every package file opened."""
    import flashinfer

    data = (Path(flashinfer.__file__).parent / "data").resolve()
    opened: set[str] = set()

    def audit(event: str, args: tuple[Any, ...]) -> None:
        if event == "open" and isinstance(args[0], str | Path):
            path = Path(args[0]).resolve()
            if path.is_relative_to(data) and path.is_file():
                opened.add(path.relative_to(data).as_posix())

    sys.addaudithook(audit)
    specs = module_specs(prefill_kernel)
    sources = [Path(s) for spec in specs for s in spec.sources]
    reached, unresolved = include_closure(sources, include_dirs(data))
    in_data = {p.relative_to(data).as_posix() for p in reached if p.is_relative_to(data)}
    return {
        "flashinfer": flashinfer.__version__,
        "modules": [{"name": s.name, "sources": len(s.sources)} for s in specs],
        "data_files": sorted(opened | in_data),
        "unresolved_includes": sorted(unresolved),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_modules", description=__doc__)
    parser.add_argument("--prefill-kernel", default="auto", choices=sorted(PREFILL_KERNELS_ON_SM90))
    args = parser.parse_args(argv)
    print(json.dumps(describe(args.prefill_kernel), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
