"""Bindings of the CPU decode-attention kernel (``engine/native/decode_attention.c``), built and
loaded by ``engine/native/build.py``.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from engine.native.build import FOLDER, try_load

SOURCE = FOLDER / "decode_attention.c"
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}


class NativeKernelError(RuntimeError):
    """The kernel could not run (it could not allocate its work buffers)."""


class DecodeKernel:
    """``atrium_decode_attention`` from the built library."""

    def __init__(self, library: Path) -> None:
        lib = ctypes.CDLL(str(library))
        fn = lib.atrium_decode_attention
        p, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
        fn.argtypes = [p, i64, p, p, p, p, p, i32, i32, i32, i32, i32, ctypes.c_float, i32, i32]
        fn.restype = ctypes.c_int
        self._fn = fn
        self.library = library

    @staticmethod
    def supports(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
        """Whether the kernel runs this model: float32 or bfloat16, head_dim a multiple of 16
        up to 256, at most 16 query heads per KV head."""
        group, uneven = divmod(num_heads, num_kv_heads)
        return (
            dtype in DTYPE_CODES
            and head_dim % 16 == 0
            and 0 < head_dim <= 256
            and not uneven
            and 0 < group <= 16
        )

    def __call__(
        self,
        q: torch.Tensor,  # [num_decodes, num_heads, head_dim], rows any stride apart
        kv_cache: torch.Tensor,  # [num_pages, 2, page_size, num_kv_heads, head_dim]
        pages: torch.Tensor,  # [total_pages] int32: block tables, one after another
        page_starts: torch.Tensor,  # [num_decodes] int32: where each decode's table starts
        kv_lens: torch.Tensor,  # [num_decodes] int32
    ) -> torch.Tensor:  # [num_decodes, num_heads, head_dim]
        num_decodes, num_heads, head_dim = q.shape
        _, two, page_size, num_kv_heads, cache_dim = kv_cache.shape
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
                f"decode kernel: unsupported q {tuple(q.shape)} {q.dtype} stride {q.stride()} "
                f"or cache {tuple(kv_cache.shape)} {kv_cache.dtype}"
            )
        for table in (pages, page_starts, kv_lens):
            if table.dtype != torch.int32 or not table.is_contiguous():
                raise ValueError("decode kernel: page tables must be contiguous int32")
        out = q.new_empty((num_decodes, num_heads, head_dim))
        status = self._fn(
            q.data_ptr(),
            q.stride(0),
            kv_cache.data_ptr(),
            out.data_ptr(),
            pages.data_ptr(),
            page_starts.data_ptr(),
            kv_lens.data_ptr(),
            num_decodes,
            num_heads,
            num_kv_heads,
            head_dim,
            page_size,
            head_dim**-0.5,
            DTYPE_CODES[q.dtype],
            torch.get_num_threads(),
        )
        if status == -2:
            raise ValueError(f"decode kernel: unsupported head_dim {head_dim} or head grouping")
        if status != 0:
            raise NativeKernelError("decode kernel could not allocate its work buffers")
        return out


def try_load_decode_kernel(cache_dir: Path | None = None) -> DecodeKernel | None:
    """The decode kernel, or None where it is turned off or cannot be built or loaded."""
    return try_load(SOURCE, DecodeKernel, cache_dir)


@functools.cache
def load_decode_kernel() -> DecodeKernel | None:
    """:func:`try_load_decode_kernel` once per process."""
    return try_load_decode_kernel()
