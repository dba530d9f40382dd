"""Sizing the KV page pool: pages or bytes when given, else a share of the memory left free once
the model is loaded (host RAM on CPU, device memory on CUDA), capped at what a full batch can use.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import NamedTuple

import torch

from engine.config import EngineConfig

# Host RAM is shared with the gateway, the tokenizers, the page cache and whatever else runs on
# the box; device memory belongs to the engine alone (what is left serves the step's activations).
CPU_MEMORY_FRACTION = 0.25
CUDA_MEMORY_FRACTION = 0.9
# Where free memory cannot be read (no /proc/meminfo, no psutil): the old fixed pool.
FALLBACK_KV_CACHE_BYTES = 256 * 2**20
MEMINFO = Path("/proc/meminfo")
CGROUP_ROOT = Path("/sys/fs/cgroup")
SELF_CGROUP = Path("/proc/self/cgroup")
_NO_LIMIT = 2**60  # cgroup v1 writes "unlimited" as a number near 2**63


class FreeMemory(NamedTuple):
    num_bytes: int
    source: str  # "meminfo", "cgroup" (a container's limit left less), "psutil" or "cuda"


class KvPoolSize(NamedTuple):
    num_pages: int
    # What decided it: "num_pages" or "kv_cache_bytes" (set), "memory_fraction" (a share of free
    # memory), "full_batch_cap" (the share was larger than a full batch can use), "fallback".
    reason: str
    fraction: float | None = None  # the share of free memory asked for
    free_bytes: int | None = None  # free memory measured before the pool was allocated


def default_memory_fraction(device_type: str) -> float:
    """The share of free memory the pool takes when no setting names one."""
    return CUDA_MEMORY_FRACTION if device_type == "cuda" else CPU_MEMORY_FRACTION


def parse_mem_available(meminfo: str) -> int | None:
    """``MemAvailable`` of a ``/proc/meminfo`` text, in bytes (None when absent or unreadable)."""
    for line in meminfo.splitlines():
        name, _, rest = line.partition(":")
        if name.strip() != "MemAvailable":
            continue
        fields = rest.split()
        if not fields or not fields[0].isdigit():
            return None
        unit = fields[1].lower() if len(fields) > 1 else "b"
        scale = {"kb": 2**10, "mb": 2**20, "gb": 2**30, "b": 1}.get(unit)
        return None if scale is None else int(fields[0]) * scale
    return None


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max" (v2): no limit


def cgroup_room(self_cgroup: str, root: Path = CGROUP_ROOT) -> int | None:
    """Bytes this process's memory cgroup still allows (limit less usage), or None without a
    limit. A container's limit is invisible in ``/proc/meminfo``, which shows the host's."""
    for line in self_cgroup.splitlines():
        _, controllers, path = line.split(":", 2)
        relative = path.lstrip("/")
        if controllers == "":  # v2: one unified hierarchy
            names = ("memory.max", "memory.current")
            dirs = [root / relative, root]
        elif "memory" in controllers.split(","):
            names = ("memory.limit_in_bytes", "memory.usage_in_bytes")
            dirs = [root / "memory" / relative, root / "memory"]
        else:
            continue
        for folder in dirs:  # the process's own path, or the namespace's root in a container
            limit, usage = _read_int(folder / names[0]), _read_int(folder / names[1])
            if limit is not None and usage is not None and limit < _NO_LIMIT:
                return max(0, limit - usage)
    return None


def free_memory(
    device: torch.device,
    meminfo: Path = MEMINFO,
    self_cgroup: Path = SELF_CGROUP,
    cgroup_root: Path = CGROUP_ROOT,
) -> FreeMemory | None:
    """Memory free for the pool now: CUDA's free bytes on a GPU (after handing the allocator's
    idle blocks back), else the host's ``MemAvailable`` (Linux) or what the process's memory
    cgroup still allows, whichever is less, else psutil's when installed."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        free, _ = torch.cuda.mem_get_info(device)
        return FreeMemory(int(free), "cuda")
    try:
        available = parse_mem_available(meminfo.read_text())
    except OSError:
        available = None
    if available is not None:
        try:
            room = cgroup_room(self_cgroup.read_text(), cgroup_root)
        except (OSError, ValueError):
            room = None
        if room is not None and room < available:
            return FreeMemory(room, "cgroup")
        return FreeMemory(available, "meminfo")
    try:
        psutil = importlib.import_module("psutil")
    except ImportError:
        return None
    return FreeMemory(int(psutil.virtual_memory().available), "psutil")


def size_kv_pool(
    config: EngineConfig,
    bytes_per_page: int,
    max_model_len: int,
    device_type: str,
    free: FreeMemory | None,
    reserved_bytes: int = 0,
) -> KvPoolSize:
    """The pool's pages for ``config``: ``num_pages``, else ``kv_cache_bytes``, else the memory
    fraction of ``free`` less ``reserved_bytes`` (what else the budget must hold: the decode
    graphs), never more than ``max_num_seqs`` requests at ``max_model_len`` need (pages past
    that could only hold more cached prefixes, at the cost of memory taken from everything
    else on the machine)."""
    if config.num_pages is not None:
        return KvPoolSize(config.num_pages, "num_pages")
    if bytes_per_page <= 0:
        raise ValueError("bytes_per_page must be positive")
    if config.kv_cache_bytes is not None:
        num_pages = config.kv_cache_bytes // bytes_per_page
        if num_pages <= 0:
            raise ValueError("kv_cache_bytes cannot hold a single page")
        return KvPoolSize(num_pages, "kv_cache_bytes")
    fraction = config.kv_cache_memory_fraction
    if fraction is None:
        fraction = default_memory_fraction(device_type)
    if free is None:
        return KvPoolSize(FALLBACK_KV_CACHE_BYTES // bytes_per_page or 1, "fallback", fraction)
    num_pages = (int(free.num_bytes * fraction) - reserved_bytes) // bytes_per_page
    if num_pages <= 0:
        reserved = f" (less {reserved_bytes} for CUDA graphs)" if reserved_bytes else ""
        raise ValueError(
            f"{fraction:g} of the {free.num_bytes} bytes free{reserved} cannot hold a KV page of "
            f"{bytes_per_page} bytes; set kv_cache_bytes or a larger kv_cache_memory_fraction"
        )
    pages_per_request = -(-max_model_len // config.page_size)
    cap = config.max_num_seqs * pages_per_request
    if num_pages > cap:
        return KvPoolSize(cap, "full_batch_cap", fraction, free.num_bytes)
    return KvPoolSize(num_pages, "memory_fraction", fraction, free.num_bytes)
