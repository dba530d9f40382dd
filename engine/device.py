"""Device and dtype resolution: turns ``--device auto|cpu|cuda[:N]`` into a ``torch.device``."""

from __future__ import annotations

import ctypes
import math
import mmap
import sys

import torch

from engine.errors import EngineError

DEVICE_CHOICES = ("auto", "cpu", "cuda")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class DeviceUnavailableError(EngineError):
    """The requested device does not exist on this machine."""

    code = "device_unavailable"


def resolve_device(spec: str | torch.device = "auto") -> torch.device:
    """``auto`` is CUDA when a GPU is visible, else CPU; an explicit ``cuda`` must exist.

    CUDA devices come back with an index (``cuda:0``) so they compare equal to a tensor's device.
    """
    text = str(spec).strip().lower()
    if text == "auto":
        text = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(text)
    except RuntimeError as exc:
        raise ValueError(f"unknown device {spec!r}; choose one of {DEVICE_CHOICES}") from exc
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type != "cuda":
        raise ValueError(f"unsupported device {spec!r}; choose one of {DEVICE_CHOICES}")
    if not torch.cuda.is_available():
        raise DeviceUnavailableError(
            f"device {spec!r} was requested but CUDA is not available "
            "(no NVIDIA GPU visible, or this torch build has no CUDA); use --device cpu or auto"
        )
    index = torch.cuda.current_device() if device.index is None else device.index
    count = torch.cuda.device_count()
    if index >= count:
        raise DeviceUnavailableError(f"device cuda:{index} does not exist ({count} visible)")
    return torch.device("cuda", index)


def dtype_name(dtype: torch.dtype) -> str:
    """The name ``resolve_dtype`` takes for ``dtype``: ``torch.float32`` -> ``float32``."""
    return str(dtype).removeprefix("torch.")


def cpu_has_bf16_dot() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX512-BF16 or AMX). Without either,
    oneDNN widens bfloat16 to float32 inside every product, and bf16 projections run several
    times slower than float32 ones."""
    cpu = torch.cpu
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(bool(getattr(cpu, name, lambda: False)()) for name in checks)


def resolve_dtype(spec: str | torch.dtype, device: torch.device) -> torch.dtype:
    """``auto`` is bfloat16 on CUDA (FlashInfer's fast path) and on a CPU with native bfloat16
    products, float32 on any other CPU."""
    if isinstance(spec, torch.dtype):
        dtype = spec
    elif spec == "auto":
        native = device.type == "cuda" or cpu_has_bf16_dot()
        dtype = torch.bfloat16 if native else torch.float32
    elif spec in _DTYPES:
        dtype = _DTYPES[spec]
    else:
        raise ValueError(f"unknown dtype {spec!r}; choose auto or one of {sorted(_DTYPES)}")
    if dtype not in _DTYPES.values():
        raise ValueError(f"unsupported dtype {dtype}; choose one of {sorted(_DTYPES)}")
    return dtype


_MADV_HUGEPAGE = 14  # Linux's madvise advice for transparent huge pages
HUGE_PAGE_BYTES = 2 * 2**20


def advise_huge_pages(t: torch.Tensor) -> bool:
    """Ask Linux to back a large CPU tensor with 2 MiB pages (``madvise(MADV_HUGEPAGE)`` over the
    whole huge pages inside it), before it is first written. Where transparent huge pages are
    on "madvise" (a common default), the KV cache and weights otherwise sit on 4 KiB pages, and
    reading a step's scattered cache pages or streaming the weights misses the TLB at nearly
    every page. Best effort: memory that malloc hands back from earlier use keeps the pages it
    has. Returns whether the advice was taken; elsewhere (not Linux, a GPU tensor, under 4 MiB,
    THP off) nothing changes."""
    size = t.numel() * t.element_size()
    if t.device.type != "cpu" or not sys.platform.startswith("linux") or size < 2 * HUGE_PAGE_BYTES:
        return False
    start = t.data_ptr()
    lo = -(-start // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    hi = (start + size) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    if hi <= lo:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return int(libc.madvise(lo, hi - lo, _MADV_HUGEPAGE)) == 0


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor of ``shape`` in memory of its own, advised onto huge pages before
    anything touches it (``advise_huge_pages``). Memory from torch's allocator may be memory
    malloc has handed out before, already on 4 KiB pages, and the advice then changes nothing;
    a fresh anonymous mapping (zero by construction, aligned to a huge page) always takes it.
    Elsewhere (not Linux, under two huge pages) a plain ``torch.zeros``."""
    size = math.prod(shape) * dtype.itemsize
    if not sys.platform.startswith("linux") or size < 2 * HUGE_PAGE_BYTES:
        return torch.zeros(shape, dtype=dtype)
    # Private: a shared anonymous mapping is shared memory, which THP's setting does not cover.
    buffer = mmap.mmap(-1, size + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    start = ctypes.addressof(ctypes.c_char.from_buffer(buffer))
    offset = -start % HUGE_PAGE_BYTES
    # The tensor keeps ``buffer`` (and so the mapping) alive for as long as it lives.
    t = torch.frombuffer(buffer, dtype=torch.uint8, count=size, offset=offset)
    advise_huge_pages(t)
    return t.view(dtype).view(shape)
