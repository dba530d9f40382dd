"""Building an engine from plain data: threads, dtype, device, the model load and the warm-up.

The gateway names a dtype and a device as strings; only this module turns them into torch's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from engine.config import EngineConfig
from engine.device import dtype_name, resolve_dtype
from engine.llm_engine import LLMEngine
from engine.load_progress import LoadProgress, NullProgress
from engine.model.loader import LoadedModel, load_model
from radix_cache import RadixPrefixCache


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """What building an engine takes; plain data, so it also crosses to a child by pickling."""

    model: str = "default"  # "default", a Hugging Face directory or a .gguf file
    dtype: str = "bfloat16"  # the weights' dtype: bfloat16, float16 or float32
    config: EngineConfig = field(default_factory=EngineConfig)  # its ``device`` loads the model
    prefix_cache: bool = True
    torch_threads: int | None = None  # None: torch's own choice
    # Run first in a child process (a picklable module-level callable, e.g. logging set-up).
    setup: Callable[[], None] | None = None


class BuiltEngine(NamedTuple):
    engine: LLMEngine  # warmed up, its KV pool allocated
    name: str  # the served model name


def resolve_device_name(spec: str = "auto") -> str:
    """``auto`` becomes ``cuda`` when a GPU is visible, else ``cpu``; other names stay."""
    if spec != "auto":
        return spec
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_dtype_name(spec: str, device: str) -> str:
    """``auto`` resolved for ``device`` (``engine.device.resolve_dtype``); other names stay."""
    if spec != "auto":
        return spec
    return dtype_name(resolve_dtype("auto", torch.device(device)))


def load(
    model: str, dtype: str, device: str = "cpu", progress: LoadProgress | None = None
) -> LoadedModel:
    """The model ``model`` names, its weights in the dtype named ``dtype`` on ``device``."""
    return load_model(model, resolve_dtype(dtype, torch.device(device)), device, progress)


def build_engine(spec: EngineSpec, progress: LoadProgress | None = None) -> BuiltEngine:
    """Set the threads, load the model and build its engine (the KV pool, and the timed steps
    that warm the kernels up for the step target). ``progress`` is told each stage (compile
    kernels, read weights, pack weights, allocate KV cache, warm up: each with a total) and
    left open for its owner to close."""
    progress = progress or NullProgress()
    if spec.torch_threads is not None:
        torch.set_num_threads(spec.torch_threads)
    loaded = load(spec.model, spec.dtype, spec.config.device, progress)
    factory = RadixPrefixCache if spec.prefix_cache else None
    engine = LLMEngine(loaded, spec.config, prefix_cache_factory=factory, progress=progress)
    return BuiltEngine(engine, loaded.name)
