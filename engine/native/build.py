"""Native CPU kernels: the C sources in this folder are built with the system C compiler on first
use, cached by the hash of sources, compiler, flags and CPU, and bound through ctypes (whose calls
release the GIL). ``engine/attention/native_attention.py`` binds the attention kernels,
``engine/model/native_ops.py`` the layer's element-wise ones.

Where no compiler is found or a build fails, the loaders return None (logged) and the callers
keep their torch code. ``ATRIUM_NATIVE_KERNELS=0`` turns them all off; ``ATRIUM_CACHE_DIR`` moves
the build cache (default ``$XDG_CACHE_HOME/atrium`` or ``~/.cache/atrium``).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import TypeVar

import structlog
import torch

from engine.load_progress import LoadProgress, NullProgress

log = structlog.get_logger(__name__)

FOLDER = Path(__file__).parent
FLAGS = (
    "-O3",
    "-march=native",
    "-fopenmp",
    "-fno-trapping-math",
    "-ffp-contract=fast",
    "-shared",
    "-fPIC",
    "-std=c11",
)
COMPILE_TIMEOUT_S = 120.0

T = TypeVar("T")


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


def cpu_has_avx512() -> bool:
    """Whether torch dispatches AVX-512 code on this CPU. The kernels here were tuned on such
    CPUs; with AVX2 alone their 16-lane vectors are two registers each and their tiles spill,
    so the callers whose kernels then lose to torch's paths use those paths instead."""
    return torch.backends.cpu.get_cpu_capability().startswith("AVX512")


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def build_library(
    source: Path, cache_dir: Path | None = None, extra_flags: tuple[str, ...] = ()
) -> Path:
    """Compile ``source`` unless a build for it (and the headers beside it), this compiler,
    these flags and this CPU is cached. ``extra_flags`` go after the standard ones (tests build
    the portable paths with e.g. ``-mno-avx512bf16``)."""
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
    headers = sorted(source.parent.glob("*.h"))
    for part in (source.read_bytes(), *(h.read_bytes() for h in headers)):
        digest.update(part)
    digest.update(version.encode())
    flags = (*FLAGS, *extra_flags)
    digest.update(" ".join(flags).encode())
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
            [compiler, *flags, f"-I{source.parent}", "-o", str(built), str(source), "-lm"],
            check=False,
            capture_output=True,
            text=True,
            timeout=COMPILE_TIMEOUT_S,
        )
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {result.stderr.strip()[-2000:]}")
        os.replace(built, target)
    # Builds of older versions of this source (or of another CPU) are not used again.
    for stale in folder.glob(f"{source.stem}-*.so"):
        if stale != target:
            stale.unlink(missing_ok=True)
    return target


def prebuild(cache_dir: Path | None = None, progress: LoadProgress | None = None) -> None:
    """Build every C source here at once, one compiler per core, where native kernels are on:
    a first start then waits for the slowest build instead of for all of them in turn (about a
    minute instead of two on a slow 2-core CPU). Failures are left for the loaders to log."""
    if not native_enabled() or _compiler() is None:
        return
    sources = sorted(FOLDER.glob("*.c"))
    progress = progress or NullProgress()
    progress.stage("compile kernels", total=len(sources), unit="kernels")
    with ThreadPoolExecutor(max_workers=max(1, min(len(sources), os.cpu_count() or 1))) as pool:
        futures = [pool.submit(build_library, source, cache_dir) for source in sources]
        for future in as_completed(futures):
            with contextlib.suppress(OSError, RuntimeError, subprocess.SubprocessError):
                future.result()
            progress.advance()


def try_load(
    source: Path,
    bind: Callable[[Path], T],
    cache_dir: Path | None = None,
    extra_flags: tuple[str, ...] = (),
) -> T | None:
    """``bind`` (ctypes bindings) over the built ``source``, or None (logged) where native
    kernels are off or ``source`` cannot be built or loaded."""
    if not native_enabled():
        return None
    started = time.perf_counter()
    try:
        library = build_library(source, cache_dir, extra_flags)
        bound = bind(library)
    except (OSError, AttributeError, RuntimeError, subprocess.SubprocessError) as exc:
        log.warning("native_kernel_unavailable", source=source.name, error=str(exc)[:500])
        return None
    log.debug("native_kernel_ready", library=str(library), seconds=time.perf_counter() - started)
    return bound
