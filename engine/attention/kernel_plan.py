"""Which FlashInfer modules the CUDA attention backend loads for a model's shape (pure, no
FlashInfer): the backend builds its wrappers from ``wrapper_requests``, and ``planned_modules``
names the JIT modules those wrappers' ``plan`` loads in FlashInfer 0.7.2.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch

from engine.config import PREFILL_KERNELS

WrapperKind = Literal["prefill", "decode"]
# FA2's prefill is two modules (the primary one, loaded by ``plan``; the paged one, by the first
# paged run); FA3's is one; the plain decode kernel is one.
ModuleFamily = Literal["fa2_prefill", "fa2_prefill_paged", "fa3_prefill", "decode"]
FLASHINFER_DTYPES = (torch.bfloat16, torch.float16)
FA3_HEAD_DIMS = (64, 128, 256)  # FA3's prefill instantiations for equal QK and VO head sizes
TENSOR_CORE_GROUP = 4  # query heads per KV head from which decodes run on tensor cores
_ARCH = re.compile(r"^(\d+)\.(\d+)([af]?)$")


class WrapperRequest(NamedTuple):
    kind: WrapperKind
    use_tensor_cores: bool
    kernel: str  # the prefill backend asked for (``PREFILL_KERNELS``); decode wrappers: fa2


@dataclass(frozen=True, slots=True)
class KernelShape:
    """What picks the modules: heads, head size, dtype and the prefill kernel. The page size is
    a run-time argument of the kernels, not part of a module."""

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.bfloat16
    prefill_kernel: str = "auto"
    use_decode_kernel: bool = True

    def __post_init__(self) -> None:
        if self.num_kv_heads < 1 or self.num_q_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"{self.num_q_heads} query heads are not a multiple of {self.num_kv_heads} KV heads"
            )
        if self.head_dim < 1:
            raise ValueError(f"head_dim must be positive, got {self.head_dim}")
        if self.dtype not in FLASHINFER_DTYPES:
            raise ValueError(f"FlashInfer runs in bfloat16 or float16, not {self.dtype}")
        if self.prefill_kernel not in PREFILL_KERNELS:
            raise ValueError(f"prefill kernel must be one of {', '.join(PREFILL_KERNELS)}")


def wrapper_requests(
    num_q_heads: int, num_kv_heads: int, prefill_kernel: str, use_decode_kernel: bool
) -> list[WrapperRequest]:
    """The wrappers the backend builds: a prefill wrapper for mixed steps and, unless turned off,
    a decode wrapper (pinned to FA2) for decode-only steps."""
    tensor_cores = num_q_heads // num_kv_heads >= TENSOR_CORE_GROUP
    requests = [WrapperRequest("prefill", tensor_cores, prefill_kernel)]
    if use_decode_kernel:
        requests.append(WrapperRequest("decode", tensor_cores, "fa2"))
    return requests


def fa3_runs(major: int, shape: KernelShape) -> bool:
    """Whether FlashInfer's ``auto`` picks FA3 on a GPU of compute capability ``major``.x."""
    return major == 9 and shape.head_dim in FA3_HEAD_DIMS


def wrapper_modules(request: WrapperRequest, fa3: bool) -> tuple[ModuleFamily, ...]:
    """The modules one wrapper's ``plan`` (and first run) loads. Tensor-core decode runs FA2's
    prefill kernel; plain decode has its own module."""
    if request.kind == "decode":
        return ("fa2_prefill", "fa2_prefill_paged") if request.use_tensor_cores else ("decode",)
    backend = "fa3" if request.kernel == "fa3" or (request.kernel == "auto" and fa3) else "fa2"
    return ("fa3_prefill",) if backend == "fa3" else ("fa2_prefill", "fa2_prefill_paged")


def planned_modules(shape: KernelShape, majors: tuple[int, ...]) -> list[ModuleFamily]:
    """Every module an engine of ``shape`` loads on a GPU of any of the ``majors`` (compute
    capability), each once, in the order the wrappers need them."""
    requests = wrapper_requests(
        shape.num_q_heads, shape.num_kv_heads, shape.prefill_kernel, shape.use_decode_kernel
    )
    found: dict[ModuleFamily, None] = {}
    for major in majors:
        for request in requests:
            found.update(dict.fromkeys(wrapper_modules(request, fa3_runs(major, shape))))
    return list(found)


def parse_arch_list(text: str) -> tuple[str, ...]:
    """``8.0;8.9;9.0a``, ``8.0 8.9 9.0a`` or ``8.0,8.9,9.0a`` as FlashInfer's entries; Hopper
    gets its arch-specific ``a`` target, as FlashInfer gives it (FA3 needs it)."""
    entries = [e for e in re.split(r"[;, ]+", text.strip()) if e]
    if not entries:
        raise ValueError("the architecture list is empty")
    out = []
    for entry in entries:
        match = _ARCH.match(entry)
        if match is None:
            raise ValueError(f"{entry!r} is not a compute capability such as 8.0 or 9.0a")
        major, minor, suffix = match.groups()
        out.append(f"{major}.{minor}{suffix or ('a' if major == '9' else '')}")
    return tuple(dict.fromkeys(out))


def arch_majors(archs: tuple[str, ...]) -> tuple[int, ...]:
    return tuple(dict.fromkeys(int(a.split(".")[0]) for a in archs))


def covers(archs: tuple[str, ...], capability: tuple[int, int]) -> bool:
    """Whether code built for ``archs`` runs on a GPU of ``capability``: a plain or family
    (``f``) target runs on its own major at the same or a later minor; an ``a`` target only on
    its own capability."""
    major, minor = capability
    for arch in archs:
        match = _ARCH.match(arch)
        if match is None:
            continue
        a_major, a_minor, suffix = int(match[1]), int(match[2]), match[3]
        if a_major == major and (a_minor == minor if suffix == "a" else a_minor <= minor):
            return True
    return False
