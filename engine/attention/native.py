"""Native CPU kernels: C sources built with the system C compiler on first use, cached by the hash
of source, compiler, flags and CPU, and called through ctypes (which releases the GIL). Here the
decode-attention kernel (``cpu_decode.c``); ``engine/model/native_ops.py`` builds the layer's
element-wise kernels the same way.

Where no compiler is found or the build fails, the loaders return None and the callers keep
their torch code. ``ATRIUM_NATIVE_KERNELS=0`` turns the kernel off;
``ATRIUM_CACHE_DIR`` moves the build cache (default ``$XDG_CACHE_HOME/atrium`` or
``~/.cache/atrium``).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import structlog
import torch

log = structlog.get_logger(__name__)

SOURCE = Path(__file__).with_name("cpu_decode.c")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-trapping-math", "-shared", "-fPIC", "-std=c11")
COMPILE_TIMEOUT_S = 120.0
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}


class NativeKernelError(RuntimeError):
    """The kernel could not run (it could not allocate its work buffers)."""


def native_enabled() -> bool:
    return os.environ.get("ATRIUM_NATIVE_KERNELS", "1").strip().lower() not in {
        "0",
        "false",
        "off",
        "no",
    }


def _cache_dir() -> Path:
    explicit = os.environ.get("ATRIUM_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "atrium"


def _cpu_flags() -> str:
    """What ``-march=native`` depends on: the CPU's feature flags (Linux), else the machine."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def build_library(cache_dir: Path | None = None, source: Path = SOURCE) -> Path:
    """Compile ``source`` unless a build for it, this compiler and this CPU is cached."""
    compiler = _compiler()
    if compiler is None:
        raise FileNotFoundError("no C compiler (cc or gcc) on PATH; set CC")
    version = subprocess.run(
        [compiler, "--version"],
        check=False,
        capture_output=True,
        text=True,
        timeout=COMPILE_TIMEOUT_S,
    ).stdout
    digest = hashlib.sha256()
    for part in (source.read_bytes(), version.encode(), " ".join(FLAGS).encode()):
        digest.update(part)
    digest.update(_cpu_flags().encode())
    folder = cache_dir or _cache_dir()
    target = folder / f"{source.stem}-{digest.hexdigest()[:16]}.so"
    if target.is_file():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent builders never see a half-written file.
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        built = Path(tmp) / target.name
        result = subprocess.run(
            [compiler, *FLAGS, "-o", str(built), str(source), "-lm"],
            check=False,
            capture_output=True,
            text=True,
            timeout=COMPILE_TIMEOUT_S,
        )
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {result.stderr.strip()[-2000:]}")
        os.replace(built, target)
    return target


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
        pages: torch.Tensor,  # [total_pages] int32, decode after decode
        page_indptr: torch.Tensor,  # [num_decodes + 1] int32
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
        for table in (pages, page_indptr, kv_lens):
            if table.dtype != torch.int32 or not table.is_contiguous():
                raise ValueError("decode kernel: page tables must be contiguous int32")
        out = q.new_empty((num_decodes, num_heads, head_dim))
        status = self._fn(
            q.data_ptr(),
            q.stride(0),
            kv_cache.data_ptr(),
            out.data_ptr(),
            pages.data_ptr(),
            page_indptr.data_ptr(),
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


def try_build(source: Path, cache_dir: Path | None = None) -> Path | None:
    """:func:`build_library`, or None (logged) where native kernels are off or cannot be built."""
    if not native_enabled():
        return None
    started = time.perf_counter()
    try:
        library = build_library(cache_dir, source)
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        log.warning("native_kernel_unavailable", source=source.name, error=str(exc)[:500])
        return None
    log.debug("native_kernel_ready", library=str(library), seconds=time.perf_counter() - started)
    return library


def try_load_decode_kernel(cache_dir: Path | None = None) -> DecodeKernel | None:
    """The decode kernel, or None where it is turned off or cannot be built or loaded."""
    library = try_build(SOURCE, cache_dir)
    if library is None:
        return None
    try:
        return DecodeKernel(library)
    except (OSError, AttributeError) as exc:
        log.warning("native_kernel_unavailable", source=SOURCE.name, error=str(exc)[:500])
        return None


@functools.cache
def load_decode_kernel() -> DecodeKernel | None:
    """:func:`try_load_decode_kernel` once per process."""
    return try_load_decode_kernel()
