"""Bindings of the CPU attention kernels, built and loaded by ``engine/native/build.py``:
decodes (``engine/native/decode_attention.c``) and prefill chunks
(``engine/native/chunk_attention.c``), both reading K and V from the paged cache in place.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import Any

import torch

from engine.native.build import FOLDER, cpu_has_avx512, try_load

DECODE_SOURCE = FOLDER / "decode_attention.c"
CHUNK_SOURCE = FOLDER / "chunk_attention.c"
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
_P, _I32, _I64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
# Both kernels end in: num_heads, num_kv_heads, head_dim, page_size, scale, dtype, threads.
_SHAPE_ARGS: list[type[ctypes._SimpleCData[Any]]] = [
    _I32,
    _I32,
    _I32,
    _I32,
    ctypes.c_float,
    _I32,
    _I32,
]


class NativeKernelError(RuntimeError):
    """The kernel could not run (it could not allocate its work buffers)."""


def kernels_support(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether the kernels run this model: float32 or bfloat16, head_dim a multiple of 16 up to
    256, at most 16 query heads per KV head."""
    group, uneven = divmod(num_heads, num_kv_heads)
    return (
        dtype in DTYPE_CODES
        and head_dim % 16 == 0
        and 0 < head_dim <= 256
        and not uneven
        and 0 < group <= 16
    )


def chunk_kernel_beats_torch(dtype: torch.dtype) -> bool:
    """Whether prefill chunks in ``dtype`` should take the C kernel on this CPU: with AVX-512
    always; with AVX2 alone in float32, which has a tile of its own there (eight-lane vectors,
    rows in passes of 24; on an AMD EPYC of family 25, float32, 32 chunks of 64 tokens over
    512 cached ones 1.6-1.8x and four fresh 512-token prompts 2.0-2.3x as fast as torch's
    SDPA). bfloat16 with AVX2 alone would run the sixteen-lane tile, two registers a vector,
    which spills (on an AMD EPYC of family 23 a prefill of 8 shared-prefix prompts took ~22.5 s
    with it and ~11.5 s with SDPA)."""
    if cpu_has_avx512():
        return True
    return torch.backends.cpu.get_cpu_capability() == "AVX2" and dtype == torch.float32


def _check(name: str, q: torch.Tensor, kv_cache: torch.Tensor, tables: list[torch.Tensor]) -> None:
    _, num_heads, head_dim = q.shape
    _, two, _, num_kv_heads, cache_dim = kv_cache.shape
    if (
        two != 2
        or cache_dim != head_dim
        or num_heads % num_kv_heads
        or q.dtype != kv_cache.dtype
        or q.dtype not in DTYPE_CODES
        or q.device.type != "cpu"
        or q.stride(2) != 1
        or q.stride(1) != head_dim
        or not kv_cache.is_contiguous()
    ):
        raise ValueError(
            f"{name} kernel: unsupported q {tuple(q.shape)} {q.dtype} stride {q.stride()} "
            f"or cache {tuple(kv_cache.shape)} {kv_cache.dtype}"
        )
    for table in tables:
        if table.dtype != torch.int32 or not table.is_contiguous():
            raise ValueError(f"{name} kernel: page tables must be contiguous int32")


def _shape_args(q: torch.Tensor, kv_cache: torch.Tensor) -> tuple[int | float, ...]:
    _, num_heads, head_dim = q.shape
    _, _, page_size, num_kv_heads, _ = kv_cache.shape
    return (
        num_heads,
        num_kv_heads,
        head_dim,
        page_size,
        head_dim**-0.5,
        DTYPE_CODES[q.dtype],
        torch.get_num_threads(),
    )


def _raise_for(name: str, status: int, q: torch.Tensor, kv_cache: torch.Tensor) -> None:
    if status == -2:
        raise ValueError(
            f"{name} kernel: unsupported head_dim {q.shape[2]} or grouping of {q.shape[1]} "
            f"query heads over {kv_cache.shape[3]} KV heads"
        )
    if status == -3:
        raise ValueError(f"{name} kernel: a chunk has qo_len < 1 or kv_len < qo_len")
    if status != 0:
        raise NativeKernelError(f"{name} kernel could not allocate its work buffers")


class _Kernel:
    """A kernel of the built library: ``fn(q, q_row_stride, cache, out, *tables, count, *shape)``
    returning a status."""

    name: str
    symbol: str
    num_tables: int

    def __init__(self, library: Path) -> None:
        fn = getattr(ctypes.CDLL(str(library)), self.symbol)
        fn.argtypes = [_P, _I64, _P, _P, *([_P] * self.num_tables), _I32, *_SHAPE_ARGS]
        fn.restype = ctypes.c_int
        self._fn = fn
        self.library = library

    supports = staticmethod(kernels_support)

    def _run(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        out: torch.Tensor,
        tables: list[torch.Tensor],
        count: int,
    ) -> None:
        """Run over inputs that passed ``_check``."""
        status = self._fn(
            q.data_ptr(),
            q.stride(0),
            kv_cache.data_ptr(),
            out.data_ptr(),
            *(t.data_ptr() for t in tables),
            count,
            *_shape_args(q, kv_cache),
        )
        _raise_for(self.name, status, q, kv_cache)


class DecodeKernel(_Kernel):
    """``atrium_decode_attention``: one query token per sequence."""

    name = "decode"
    symbol = "atrium_decode_attention"
    num_tables = 3  # pages, page_starts, kv_lens

    def __call__(
        self,
        q: torch.Tensor,  # [num_decodes, num_heads, head_dim], rows any stride apart
        kv_cache: torch.Tensor,  # [num_pages, 2, page_size, num_kv_heads, head_dim]
        pages: torch.Tensor,  # [total_pages] int32: block tables, one after another
        page_starts: torch.Tensor,  # [num_decodes] int32: where each decode's table starts
        kv_lens: torch.Tensor,  # [num_decodes] int32
    ) -> torch.Tensor:  # [num_decodes, num_heads, head_dim]
        tables = [pages, page_starts, kv_lens]
        _check(self.name, q, kv_cache, tables)
        out = q.new_empty(q.shape)
        self._run(q, kv_cache, out, tables, q.shape[0])
        return out


class ChunkKernel(_Kernel):
    """``atrium_chunk_attention``: causal attention of prefill chunks over their cached tokens
    (the chunk's own K/V already written)."""

    name = "chunk"
    symbol = "atrium_chunk_attention"
    num_tables = 5  # pages, q_starts, q_lens, page_starts, kv_lens

    def __call__(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim], rows any stride apart
        kv_cache: torch.Tensor,  # [num_pages, 2, page_size, num_kv_heads, head_dim]
        out: torch.Tensor,  # [num_tokens, num_heads, head_dim] contiguous: chunk rows written
        pages: torch.Tensor,  # [total_pages] int32: block tables, one after another
        q_starts: torch.Tensor,  # [num_chunks] int32: each chunk's first row of q and out
        q_lens: torch.Tensor,  # [num_chunks] int32: its query tokens
        page_starts: torch.Tensor,  # [num_chunks] int32: where its table starts in ``pages``
        kv_lens: torch.Tensor,  # [num_chunks] int32: tokens it attends over, its own included
    ) -> None:
        tables = [pages, q_starts, q_lens, page_starts, kv_lens]
        _check(self.name, q, kv_cache, tables)
        if out.shape != q.shape or out.dtype != q.dtype or not out.is_contiguous():
            raise ValueError("chunk kernel: out must be contiguous and shaped like q")
        num_chunks = q_starts.shape[0]
        if not (q_lens.shape[0] == page_starts.shape[0] == kv_lens.shape[0] == num_chunks):
            raise ValueError("chunk kernel: one q_start, q_len, page_start and kv_len per chunk")
        if num_chunks and int((q_starts + q_lens).max()) > q.shape[0]:
            raise ValueError("chunk kernel: a chunk's rows run past q")
        self._run(q, kv_cache, out, tables, num_chunks)


def try_load_decode_kernel(
    cache_dir: Path | None = None, extra_flags: tuple[str, ...] = ()
) -> DecodeKernel | None:
    """The decode kernel, or None where it is turned off or cannot be built or loaded."""
    return try_load(DECODE_SOURCE, DecodeKernel, cache_dir, extra_flags)


def try_load_chunk_kernel(
    cache_dir: Path | None = None, extra_flags: tuple[str, ...] = ()
) -> ChunkKernel | None:
    """The prefill-chunk kernel, or None where it is turned off or cannot be built or loaded."""
    return try_load(CHUNK_SOURCE, ChunkKernel, cache_dir, extra_flags)


@functools.cache
def load_decode_kernel() -> DecodeKernel | None:
    """:func:`try_load_decode_kernel` once per process."""
    return try_load_decode_kernel()


@functools.cache
def load_chunk_kernel() -> ChunkKernel | None:
    """:func:`try_load_chunk_kernel` once per process."""
    return try_load_chunk_kernel()
