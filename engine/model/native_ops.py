"""Bindings of two of the decoder layer's element-wise steps in one C pass each
(``engine/native/layer_ops.c``), for bfloat16 and float32 on the CPU: RMSNorm and RoPE in place.
Built and loaded by ``engine/native/build.py``; where that is not possible the model keeps its
torch code.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import Any

import torch

from engine.native.build import FOLDER, try_load

SOURCE = FOLDER / "layer_ops.c"
MAX_HEAD_DIM = 512  # rope keeps half a head in two stack arrays of 256 floats


DTYPES = (torch.bfloat16, torch.float32)


def _rows(t: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    """Refuse what the C loops would misread: they take CPU rows of contiguous elements, all of
    one dtype (bfloat16 or float32)."""
    if t.dtype not in DTYPES or t.device.type != "cpu" or t.stride(-1) != 1:
        raise ValueError(f"{what}: need a bfloat16 or float32 CPU tensor with contiguous rows")
    if t.dtype != dtype:
        raise ValueError(f"{what}: {t.dtype} beside {dtype}")


class NativeOps:
    """ctypes bindings of ``layer_ops.c``."""

    def __init__(self, library: Path) -> None:
        lib = ctypes.CDLL(str(library))
        p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
        self._rms_norm: dict[torch.dtype, Any] = {}
        self._rope: dict[torch.dtype, Any] = {}
        for dtype, suffix in ((torch.bfloat16, "bf16"), (torch.float32, "f32")):
            norm = getattr(lib, f"atrium_rms_norm_{suffix}")
            norm.argtypes = [p, i64, p, p, i64, i64, f32, i32]
            norm.restype = None
            rope = getattr(lib, f"atrium_rope_{suffix}")
            rope.argtypes = [p, i64, p, p, i64, i64, i64, i32]
            rope.restype = None
            self._rms_norm[dtype], self._rope[dtype] = norm, rope
        self.library = library

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``x`` [rows, hidden] -> a new [rows, hidden]."""
        _rows(x, x.dtype, "rms_norm input")
        _rows(weight, x.dtype, "rms_norm weight")
        rows, hidden = x.shape
        if weight.shape != (hidden,) or not weight.is_contiguous():
            raise ValueError(f"rms_norm: weight {tuple(weight.shape)} for hidden size {hidden}")
        out = torch.empty((rows, hidden), dtype=x.dtype)
        self._rms_norm[x.dtype](
            x.data_ptr(),
            x.stride(0),
            weight.data_ptr(),
            out.data_ptr(),
            rows,
            hidden,
            eps,
            torch.get_num_threads(),
        )
        return out

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Rotate ``x`` [rows, heads, head_dim] (heads contiguous) in place by ``cos`` and the
        signed ``sin`` (each [rows, 1, head_dim] or [rows, head_dim], contiguous)."""
        _rows(x, x.dtype, "rope input")
        rows, heads, head_dim = x.shape
        if x.stride(1) != head_dim or head_dim % 2 or head_dim > MAX_HEAD_DIM:
            raise ValueError(f"rope: unsupported input {tuple(x.shape)} stride {x.stride()}")
        for table in (cos, sin):
            _rows(table, x.dtype, "rope table")
            if table.numel() != rows * head_dim or not table.is_contiguous():
                raise ValueError(f"rope: table {tuple(table.shape)} for {rows} x {head_dim}")
        self._rope[x.dtype](
            x.data_ptr(),
            x.stride(0),
            cos.data_ptr(),
            sin.data_ptr(),
            rows,
            heads,
            head_dim,
            torch.get_num_threads(),
        )


def try_load_native_ops(cache_dir: Path | None = None) -> NativeOps | None:
    return try_load(SOURCE, NativeOps, cache_dir)


@functools.cache
def load_native_ops() -> NativeOps | None:
    """:func:`try_load_native_ops` once per process."""
    return try_load_native_ops()
