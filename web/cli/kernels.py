"""``atrium kernels build``: compile the FlashInfer modules a model's CUDA engine loads, ahead of
time and without a GPU (nvcc and g++), into FlashInfer's cache or, with ``--prebuilt``, beside
FlashInfer as prebuilt modules; ``--dry-run`` and ``--check`` only list them."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from engine.attention import flashinfer_kernels as fk
from engine.attention.backend import BackendUnavailableError
from engine.attention.kernel_plan import KernelShape, arch_majors, parse_arch_list
from engine.config import PREFILL_KERNELS
from web.cli.env import EXIT_USAGE, env_default

EXIT_FAILED = 1  # a module is missing (--check), or compiling failed
DESCRIPTION = (
    "Compile the FlashInfer modules the CUDA attention backend loads for a model (or for "
    "explicit --heads and --head-dim), so an engine starts without compiling. Needs FlashInfer, "
    "nvcc, g++ and ninja, not a GPU: without one, name the targets with --arch-list. Modules go "
    "to FlashInfer's cache under FLASHINFER_WORKSPACE_BASE (engines find them there when they "
    "target the same list: the same GPU, or the same FLASHINFER_CUDA_ARCH_LIST), or with "
    "--prebuilt beside FlashInfer itself, loaded on any listed GPU without compiling or writing."
)


class KernelsError(Exception):
    """A failure explained in one line; ``status`` is the exit status."""

    def __init__(self, message: str, status: int = EXIT_USAGE) -> None:
        super().__init__(message)
        self.status = status


def register(subparsers: Any) -> None:
    kernels: argparse.ArgumentParser = subparsers.add_parser(
        "kernels", help="FlashInfer kernels for CUDA engines"
    )
    commands = kernels.add_subparsers(dest="kernels_command", required=True, metavar="COMMAND")
    build = commands.add_parser("build", help="compile a model's kernels", description=DESCRIPTION)
    build.add_argument(
        "--model",
        default=env_default("ATRIUM_MODEL", "default"),
        help="the model whose shape picks the kernels: 'default', a folder or a .gguf file",
    )
    build.add_argument("--heads", metavar="Q/KV", help="query and KV heads instead of a model")
    build.add_argument("--head-dim", type=int, help="the head size, with --heads")
    build.add_argument(
        "--dtype",
        default=env_default("ATRIUM_DTYPE", "bfloat16"),
        help="bfloat16 or float16 (auto: bfloat16, as on CUDA; env ATRIUM_DTYPE)",
    )
    build.add_argument(
        "--prefill-kernel",
        default=env_default("ATRIUM_PREFILL_KERNEL", "auto"),
        choices=PREFILL_KERNELS,
        help="the engine's prefill kernel (auto: FA3 on Hopper; env ATRIUM_PREFILL_KERNEL)",
    )
    build.add_argument(
        "--arch-list",
        default=env_default("FLASHINFER_CUDA_ARCH_LIST"),
        metavar="LIST",
        help="compute capabilities to compile for, e.g. '8.0 8.9 9.0a' (default: "
        "FLASHINFER_CUDA_ARCH_LIST, else this machine's GPU)",
    )
    build.add_argument(
        "--prebuilt",
        action="store_true",
        help="also install the modules into FlashInfer's own prebuilt folder (image builds)",
    )
    mode = build.add_mutually_exclusive_group()
    mode.add_argument("--dry-run", action="store_true", help="list the modules, compile nothing")
    mode.add_argument("--check", action="store_true", help="as --dry-run; exit 1 if any is missing")
    build.add_argument("--json", action="store_true", help="print the result as JSON")
    build.set_defaults(func=run_build)


def shape_of(args: argparse.Namespace) -> KernelShape:
    heads = None
    if args.heads is not None or args.head_dim is not None:
        q, _, kv = (args.heads or "").partition("/")
        if not (q.isdigit() and kv.isdigit()) or args.head_dim is None:
            raise KernelsError("--heads Q/KV (e.g. 32/8) and --head-dim go together")
        heads = (int(q), int(kv))
    return fk.shape_of(args.model, heads, args.head_dim, args.dtype, args.prefill_kernel)


def arch_list_of(args: argparse.Namespace) -> tuple[str, ...]:
    found = args.arch_list or fk.visible_gpu_arch()
    if found is None:
        raise KernelsError("no GPU here: name the targets with --arch-list, e.g. '8.0 8.9 9.0a'")
    return parse_arch_list(found)


def missing_tools() -> list[str]:
    """What FlashInfer's JIT runs that is not here (nvcc from CUDA_HOME or PATH, g++, ninja)."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    nvcc = Path(home, "bin", "nvcc").is_file() if home else shutil.which("nvcc") is not None
    found = {"nvcc": nvcc, "g++": shutil.which("g++") is not None}
    found["ninja"] = shutil.which("ninja") is not None
    return [tool for tool, ok in found.items() if not ok]


def build(args: argparse.Namespace) -> tuple[dict[str, Any], int]:
    shape, archs = shape_of(args), arch_list_of(args)
    fk.set_arch_list(archs)  # before FlashInfer's first import: it names the cache by them
    env = fk.flashinfer_module("flashinfer.jit.env")
    families_states = fk.module_states(shape, arch_majors(archs))
    report: dict[str, Any] = {
        "flashinfer": fk.flashinfer_module("flashinfer").__version__,
        "arch_list": list(archs),
        "cache_dir": str(env.FLASHINFER_JIT_DIR),
        "modules": [{"family": s.family, "name": s.name, "where": s.where}
                    for s in families_states],
    }  # fmt: skip
    if args.dry_run or args.check:
        missing = any(s.where == "missing" for s in families_states)
        return report, EXIT_FAILED if args.check and missing else 0
    lacking = missing_tools()
    if lacking:
        raise KernelsError(
            f"{' and '.join(lacking)} not found: FlashInfer compiles with the CUDA toolkit's nvcc "
            "(PATH or CUDA_HOME), g++ and ninja",
            EXIT_FAILED,
        )
    specs = fk.module_specs(shape, [s.family for s in families_states])
    try:
        compiled = {row["module"]: row["compile_s"] for row in fk.compile_modules(specs)}
    except Exception as exc:  # nvcc's, the linker's or ninja's failure: its last lines
        lines = [line for line in str(exc).splitlines() if line.strip()]
        raise KernelsError("compiling failed: " + "\n".join(lines[-12:]), EXIT_FAILED) from exc
    if args.prebuilt:
        report["prebuilt_dir"] = str(fk.install_prebuilt(specs, archs))
    for row, spec in zip(report["modules"], specs, strict=True):
        row["where"] = fk.where(spec)
        row["compile_s"] = compiled.get(spec.name, 0.0)
    return report, 0


def run_build(args: argparse.Namespace) -> int:
    try:
        report, status = build(args)
    except KernelsError as exc:
        return fail(str(exc), exc.status)
    except BackendUnavailableError as exc:
        return fail(str(exc), EXIT_FAILED)
    except (ValueError, FileNotFoundError) as exc:
        return fail(str(exc), EXIT_USAGE)
    except OSError as exc:
        return fail(f"cannot write the kernels: {exc}", EXIT_FAILED)
    if args.json:
        print(json.dumps(report))
        return status
    print(f"FlashInfer {report['flashinfer']}, targets {' '.join(report['arch_list'])}")
    print(f"cache: {report['cache_dir']}")
    if "prebuilt_dir" in report:
        print(f"prebuilt: {report['prebuilt_dir']}")
    for row in report["modules"]:
        took = f" ({row['compile_s']} s)" if row.get("compile_s") else ""
        print(f"  {row['where']:<9} {row['family']:<18} {row['name']}{took}")
    return status


def fail(message: str, status: int) -> int:
    print(f"atrium kernels build: {message.strip()}", file=sys.stderr)
    return status
