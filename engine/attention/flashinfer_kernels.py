"""FlashInfer's JIT modules for a shape (``kernel_plan.py``): generated, checked, compiled ahead of
time (nvcc and g++, no GPU) and installed as prebuilt; and, at an engine's start, which of them
would still compile. Imports FlashInfer lazily: call ``set_arch_list`` before the first import.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import structlog
import torch

from engine.attention.backend import BackendUnavailableError
from engine.attention.kernel_plan import (
    KernelShape,
    ModuleFamily,
    covers,
    planned_modules,
)
from engine.model.loader import load_config

log = structlog.get_logger(__name__)
ARCH_ENV = "FLASHINFER_CUDA_ARCH_LIST"  # the only variable FlashInfer 0.7.2 reads for targets
MANIFEST = "atrium-kernels.json"  # beside the prebuilt modules: the targets each was built for
Where = Literal["prebuilt", "cached", "missing"]
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, slots=True)
class ModuleState:
    family: ModuleFamily
    name: str  # FlashInfer's module name (its URI): the cache folder and the .so are named so
    where: Where  # prebuilt: FlashInfer's AOT folder; cached: its JIT cache; missing: compiles


def shape_of(
    model: str, heads: tuple[int, int] | None, head_dim: int | None, dtype: str, prefill: str
) -> KernelShape:
    """The kernel shape of explicit ``heads`` and ``head_dim``, else of ``model``'s config;
    ValueError for a dtype FlashInfer does not run or a model the FlashInfer backend refuses."""
    torch_dtype = DTYPES.get("bfloat16" if dtype == "auto" else dtype)
    if torch_dtype is None:
        raise ValueError(f"FlashInfer runs in bfloat16 or float16, not {dtype}")
    if heads is not None and head_dim is not None:
        return KernelShape(heads[0], heads[1], head_dim, torch_dtype, prefill)
    config = load_config(model)
    refused = sorted({layer.describe() for layer in config.attention_layers if not layer.plain})
    if refused:
        raise ValueError(
            f"the FlashInfer backend refuses this model ({', '.join(refused)}); its engines run "
            "the torch backend, which compiles nothing"
        )
    return KernelShape(config.num_heads, config.num_kv_heads, config.head_dim, torch_dtype, prefill)


def visible_gpu_arch() -> str | None:
    """This machine's first GPU as a compute capability (``9.0``), or None without one."""
    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    return f"{major}.{minor}"


def set_arch_list(archs: Sequence[str]) -> None:
    """Name the compile targets; FlashInfer reads them (space-separated) when first imported."""
    os.environ[ARCH_ENV] = " ".join(archs)


def flashinfer_module(name: str) -> Any:
    """A FlashInfer submodule, or BackendUnavailableError with the install hint."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        missing = isinstance(exc, ModuleNotFoundError) and exc.name == "flashinfer"
        cause = "is not installed" if missing else f"failed to import ({exc})"
        raise BackendUnavailableError(
            f"FlashInfer {cause}: pip install 'atrium[gpu]' (flashinfer-python==0.7.2.post1)"
        ) from exc


def module_specs(shape: KernelShape, families: Sequence[ModuleFamily]) -> list[Any]:
    """FlashInfer's JIT specs for ``families`` (generates their sources; no GPU needed), with the
    arguments the wrappers pass: int32 page indices, no RoPE in the kernel, no sliding window,
    no soft-capping, no fp16 QK reduction, the output in the input dtype."""
    modules = flashinfer_module("flashinfer.jit.attention.modules")
    dt, d = shape.dtype, shape.head_dim
    args = (dt, dt, dt, torch.int32, d, d, 0, False, False, False)
    make = {
        "fa2_prefill": lambda: modules._gen_batch_prefill_primary_module("fa2", *args),
        "fa2_prefill_paged": lambda: modules._gen_batch_prefill_independent_paged_module(
            "fa2", *args
        ),
        "fa3_prefill": lambda: modules.gen_batch_prefill_module("fa3", *args),
        "decode": lambda: modules.gen_batch_decode_module(*args[:-1]),
    }
    return [make[family]() for family in families]


def where(spec: Any) -> Where:
    if spec.is_aot:
        return "prebuilt"
    return "cached" if Path(spec.jit_library_path).is_file() else "missing"


def module_states(shape: KernelShape, majors: tuple[int, ...]) -> list[ModuleState]:
    families = planned_modules(shape, majors)
    specs = module_specs(shape, families)
    return [ModuleState(f, s.name, where(s)) for f, s in zip(families, specs, strict=True)]


def compile_modules(specs: Sequence[Any]) -> list[dict[str, Any]]:
    """Compile every module not yet built, all at once (nvcc and ninja, no GPU), each timed."""

    def build(spec: Any) -> dict[str, Any]:
        start = time.perf_counter()
        spec.build(need_lock=True)
        return {"module": spec.name, "compile_s": round(time.perf_counter() - start, 1)}

    todo = [spec for spec in specs if where(spec) == "missing"]
    if not todo:
        return []
    with ThreadPoolExecutor(max_workers=len(todo)) as pool:
        return list(pool.map(build, todo))


def aot_dir() -> Path:
    """FlashInfer's own folder of prebuilt modules, which it loads without compiling."""
    return Path(flashinfer_module("flashinfer.jit.env").FLASHINFER_AOT_DIR)


def install_prebuilt(specs: Sequence[Any], archs: Sequence[str]) -> Path:
    """Copy each compiled module into FlashInfer's AOT folder and record its targets there
    (the engine refuses a GPU they do not cover rather than fail at the first kernel)."""
    target = aot_dir()
    manifest_path = target / MANIFEST
    manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {}
    for spec in specs:
        built = Path(spec.jit_library_path)
        if not built.is_file():
            raise FileNotFoundError(f"{spec.name} is not compiled ({built})")
        dest = target / spec.name / f"{spec.name}.so"
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(built, dest)
        manifest[spec.name] = list(archs)
    manifest_path.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return target


def check_targets(states: Sequence[ModuleState], capability: tuple[int, int]) -> None:
    """Refuse a GPU the prebuilt modules or ``FLASHINFER_CUDA_ARCH_LIST`` do not cover: their
    kernels would load and then fail at the first launch."""
    gpu = f"{capability[0]}.{capability[1]}"
    wanted = os.environ.get(ARCH_ENV)
    if wanted and not covers(tuple(wanted.split()), capability):
        raise BackendUnavailableError(
            f"{ARCH_ENV}={wanted!r} leaves out this GPU ({gpu}): unset it or add {gpu}"
        )
    manifest_path = aot_dir() / MANIFEST
    if not manifest_path.is_file():
        return
    manifest = json.loads(manifest_path.read_text())
    for state in states:
        archs = tuple(manifest.get(state.name, ()))
        if state.where == "prebuilt" and archs and not covers(archs, capability):
            raise BackendUnavailableError(
                f"the prebuilt FlashInfer module {state.name} was built for {' '.join(archs)}, "
                f"not this GPU ({gpu}): rebuild the image with {gpu} in its KERNEL_ARCHS"
            )


def startup_states(shape: KernelShape, device: torch.device) -> list[ModuleState]:
    """The engine's modules on ``device`` and where each is, logged as ``flashinfer_kernels``;
    ``missing`` ones compile on first use (warm-up or the first request)."""
    capability = torch.cuda.get_device_capability(device)
    states = module_states(shape, (capability[0],))
    check_targets(states, capability)
    log.info(
        "flashinfer_kernels",
        modules=[s.name for s in states],
        prebuilt=sum(s.where == "prebuilt" for s in states),
        cached=sum(s.where == "cached" for s in states),
        to_compile=sum(s.where == "missing" for s in states),
        missing=[s.name for s in states if s.where == "missing"],
    )
    return states
