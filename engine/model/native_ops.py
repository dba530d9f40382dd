"""Bindings of two of the decoder layer's element-wise steps in one C pass each
(``engine/native/layer_ops.c``), for bfloat16 on the CPU: RMSNorm and RoPE in place. Built and
loaded by ``engine/native/build.py``; where that is not possible the model keeps its torch code.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from engine.native.build import FOLDER, try_load

SOURCE = FOLDER / "layer_ops.c"
MAX_HEAD_DIM = 512  # rope keeps half a head in two stack arrays of 256 floats


def _bf16_rows(t: torch.Tensor, what: str) -> None:
    """Refuse what the C loops would misread: they take bf16 CPU rows of contiguous elements."""
    if t.dtype != torch.bfloat16 or t.device.type != "cpu" or t.stride(-1) != 1:
        raise ValueError(f"{what}: need a bfloat16 CPU tensor with contiguous rows")


class NativeOps:
    """ctypes bindings of ``layer_ops.c``."""

    def __init__(self, library: Path) -> None:
        lib = ctypes.CDLL(str(library))
        p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
        self._rms_norm = lib.atrium_rms_norm_bf16
        self._rms_norm.argtypes = [p, i64, p, p, i64, i64, f32, i32]
        self._rms_norm.restype = None
        self._rope = lib.atrium_rope_bf16
        self._rope.argtypes = [p, i64, p, p, i64, i64, i64, i32]
        self._rope.restype = None
        self.library = library

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``x`` [rows, hidden] -> a new [rows, hidden]."""
        _bf16_rows(x, "rms_norm input")
        _bf16_rows(weight, "rms_norm weight")
        rows, hidden = x.shape
        if weight.shape != (hidden,) or not weight.is_contiguous():
            raise ValueError(f"rms_norm: weight {tuple(weight.shape)} for hidden size {hidden}")
        out = torch.empty((rows, hidden), dtype=x.dtype)
        self._rms_norm(
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
        _bf16_rows(x, "rope input")
        rows, heads, head_dim = x.shape
        if x.stride(1) != head_dim or head_dim % 2 or head_dim > MAX_HEAD_DIM:
            raise ValueError(f"rope: unsupported input {tuple(x.shape)} stride {x.stride()}")
        for table in (cos, sin):
            _bf16_rows(table, "rope table")
            if table.numel() != rows * head_dim or not table.is_contiguous():
                raise ValueError(f"rope: table {tuple(table.shape)} for {rows} x {head_dim}")
        self._rope(
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
