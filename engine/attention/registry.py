"""Backend selection: torch on CPU; FlashInfer on CUDA, imported only when it is built."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final, Protocol

import structlog
import torch

from engine.attention.backend import AttentionBackend, BackendUnavailableError
from engine.attention.kernel_plan import FLASHINFER_DTYPES, KernelShape
from engine.attention.native_attention import (
    chunk_kernel_beats_torch,
    kernels_support,
    load_chunk_kernel,
    load_decode_kernel,
)
from engine.attention.torch_backend import TorchAttentionBackend

log = structlog.get_logger(__name__)


class AttentionShape(Protocol):
    """The model facts a backend needs; ``ModelConfig`` satisfies it."""

    @property
    def num_heads(self) -> int: ...

    @property
    def num_kv_heads(self) -> int: ...

    @property
    def head_dim(self) -> int: ...


@dataclass(frozen=True, slots=True)
class BackendSpec:
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: torch.dtype
    device: torch.device
    num_pages: int | None
    prefill_kernel: str = "auto"  # FlashInfer's prefill backend: auto (FA3 on sm90), fa2, fa3


def _build_torch(spec: BackendSpec) -> AttentionBackend:
    if spec.device.type == "cpu" and kernels_support(
        spec.dtype, spec.num_q_heads, spec.num_kv_heads, spec.head_dim
    ):
        chunks = load_chunk_kernel() if chunk_kernel_beats_torch(spec.dtype) else None
        return TorchAttentionBackend(load_decode_kernel(), chunks)
    return TorchAttentionBackend()


def _build_flashinfer(spec: BackendSpec) -> AttentionBackend:
    if spec.device.type != "cuda":
        raise BackendUnavailableError(f"FlashInfer needs a CUDA device, not {spec.device}")
    if spec.dtype not in FLASHINFER_DTYPES:
        raise BackendUnavailableError(
            f"FlashInfer runs in bfloat16 or float16, not {spec.dtype}; pick --dtype bfloat16"
        )
    from engine.attention.flashinfer_backend import (  # noqa: PLC0415 (lazy: CUDA, optional extra)
        FlashInferAttentionBackend,
        load_flashinfer,
    )
    from engine.attention.flashinfer_kernels import startup_states  # noqa: PLC0415 (likewise)

    load_flashinfer()  # fail here, with the install hint, rather than on the first step
    shape = KernelShape(spec.num_q_heads, spec.num_kv_heads, spec.head_dim, spec.dtype,
                        spec.prefill_kernel)  # fmt: skip
    try:
        startup_states(shape, spec.device)  # logs which modules would compile; refuses a GPU
    except BackendUnavailableError:  # a GPU the kernels were not built for
        raise
    except Exception as exc:  # the report only: the first plan meets any real fault again
        log.warning("flashinfer_kernels_unknown", error=f"{type(exc).__name__}: {exc}")
    return FlashInferAttentionBackend(
        spec.num_q_heads,
        spec.num_kv_heads,
        spec.head_dim,
        spec.page_size,
        spec.dtype,
        spec.device,
        num_pages=spec.num_pages,
        prefill_kernel=spec.prefill_kernel,
    )


BACKENDS: Final[Mapping[str, Callable[[BackendSpec], AttentionBackend]]] = MappingProxyType(
    {"torch": _build_torch, "flashinfer": _build_flashinfer}
)
DEFAULT_BACKEND: Final[Mapping[str, str]] = MappingProxyType({"cpu": "torch", "cuda": "flashinfer"})


def backend_name_for(device: torch.device) -> str:
    """The backend a device gets when none is named."""
    name = DEFAULT_BACKEND.get(device.type)
    if name is None:
        raise BackendUnavailableError(f"no attention backend for device type {device.type!r}")
    return name


def create_backend(
    device: torch.device,
    model: AttentionShape,
    *,
    page_size: int,
    dtype: torch.dtype,
    num_pages: int | None = None,
    name: str | None = None,
    prefill_kernel: str = "auto",
) -> AttentionBackend:
    """Build the attention backend for ``device`` (or the one ``name``d, e.g. torch on CUDA)."""
    chosen = name or backend_name_for(device)
    factory = BACKENDS.get(chosen)
    if factory is None:
        raise ValueError(f"unknown attention backend {chosen!r}; choose one of {sorted(BACKENDS)}")
    spec = BackendSpec(
        num_q_heads=model.num_heads,
        num_kv_heads=model.num_kv_heads,
        head_dim=model.head_dim,
        page_size=page_size,
        dtype=dtype,
        device=device,
        num_pages=num_pages,
        prefill_kernel=prefill_kernel,
    )
    backend = factory(spec)
    # Sliding windows, soft-capping and scales (ModelConfig.attention_layers) not every
    # backend runs: refused here, at start, rather than at the first step.
    for layer in set(getattr(model, "attention_layers", ())):
        if not backend.serves(layer):
            raise BackendUnavailableError(
                f"the {chosen} attention backend lacks {layer.describe()}, which this model "
                "uses; choose the torch backend"
            )
    return backend
