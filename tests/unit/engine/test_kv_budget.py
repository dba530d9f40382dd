"""Sizing the KV pool: explicit settings win, else a share of free memory under a full-batch cap."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from structlog.testing import capture_logs

from engine.config import EngineConfig
from engine.kv_budget import (
    FALLBACK_KV_CACHE_BYTES,
    FreeMemory,
    cgroup_room,
    free_memory,
    parse_mem_available,
    size_kv_pool,
)
from engine.llm_engine import LLMEngine
from engine.model.loader import load_model

MEMINFO = """MemTotal:       24576000 kB
MemFree:         1048576 kB
MemAvailable:   20971520 kB
Buffers:          123456 kB
Cached:          2097152 kB
"""
PAGE = 16 * 2**10  # bytes of one page over all layers, for the sizing arithmetic


def test_mem_available_is_read_in_bytes() -> None:
    assert parse_mem_available(MEMINFO) == 20971520 * 1024
    assert parse_mem_available("MemTotal: 100 kB\n") is None
    assert parse_mem_available("MemAvailable: lots kB\n") is None
    assert parse_mem_available("MemAvailable: 12 furlongs\n") is None


def test_free_memory_reads_meminfo_on_cpu(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(MEMINFO)
    no_cgroup = tmp_path / "no-cgroup"
    got = free_memory(torch.device("cpu"), meminfo, no_cgroup)
    assert got == FreeMemory(20971520 * 1024, "meminfo")


def test_a_container_limit_lowers_free_memory(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(MEMINFO)  # the host's 20 GiB available
    v2 = tmp_path / "v2"
    (v2 / "pod").mkdir(parents=True)
    (v2 / "pod" / "memory.max").write_text(f"{4 * 2**30}\n")
    (v2 / "pod" / "memory.current").write_text(f"{2**30}\n")
    self_v2 = tmp_path / "self-v2"
    self_v2.write_text("0::/pod\n")
    got = free_memory(torch.device("cpu"), meminfo, self_v2, v2)
    assert got == FreeMemory(3 * 2**30, "cgroup")
    (v2 / "pod" / "memory.max").write_text("max\n")
    assert free_memory(torch.device("cpu"), meminfo, self_v2, v2) == (20971520 * 1024, "meminfo")
    v1 = tmp_path / "v1"
    (v1 / "memory" / "job").mkdir(parents=True)
    (v1 / "memory" / "job" / "memory.limit_in_bytes").write_text(f"{2**31}\n")
    (v1 / "memory" / "job" / "memory.usage_in_bytes").write_text(f"{2**30}\n")
    assert cgroup_room("7:pids:/\n4:memory:/job\n", v1) == 2**30
    (v1 / "memory" / "job" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert cgroup_room("4:memory:/job\n", v1) is None


def test_free_memory_unknown_without_meminfo_or_psutil(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "psutil", None)  # importing it now raises ImportError
    absent = tmp_path / "absent"
    assert free_memory(torch.device("cpu"), absent, absent) is None


def test_a_share_of_free_memory_by_default() -> None:
    config = EngineConfig(max_num_seqs=64)
    free = FreeMemory(4 * 2**30, "meminfo")
    size = size_kv_pool(config, PAGE, 32768, "cpu", free)
    # 0.25 of 4 GiB in 16 KiB pages, under the cap of 64 requests x 2048 pages.
    assert size == (2**30 // PAGE, "memory_fraction", 0.25, 4 * 2**30)
    on_gpu = size_kv_pool(config, PAGE, 32768, "cuda", free)
    assert on_gpu.fraction == 0.9
    assert on_gpu.num_pages == 64 * 2048  # 0.9 of 4 GiB would be 235,929 pages: capped
    assert on_gpu.reason == "full_batch_cap"


def test_the_fraction_setting_scales_the_pool() -> None:
    free = FreeMemory(2**30, "meminfo")
    small = size_kv_pool(EngineConfig(kv_cache_memory_fraction=0.1), PAGE, 8192, "cpu", free)
    large = size_kv_pool(EngineConfig(kv_cache_memory_fraction=0.5), PAGE, 8192, "cpu", free)
    assert small.num_pages == int(2**30 * 0.1) // PAGE
    assert large.num_pages == 2**29 // PAGE


def test_the_cap_is_a_full_batch_at_full_context() -> None:
    config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=64)
    size = size_kv_pool(config, PAGE, 100, "cpu", FreeMemory(2**40, "meminfo"))
    assert size.num_pages == 4 * 7  # 100 tokens need 7 pages of 16
    assert size.reason == "full_batch_cap"


def test_explicit_pages_and_bytes_override_the_share() -> None:
    free = FreeMemory(2**40, "meminfo")
    assert size_kv_pool(EngineConfig(num_pages=12), PAGE, 8192, "cpu", free).num_pages == 12
    by_bytes = EngineConfig(kv_cache_bytes=4 * 2**30, kv_cache_memory_fraction=0.01)
    size = size_kv_pool(by_bytes, PAGE, 8192, "cpu", free)
    assert size == (4 * 2**30 // PAGE, "kv_cache_bytes", None, None)
    with pytest.raises(ValueError, match="single page"):
        size_kv_pool(EngineConfig(kv_cache_bytes=PAGE - 1), PAGE, 8192, "cpu", free)


def test_unknown_free_memory_falls_back_and_too_little_is_refused() -> None:
    size = size_kv_pool(EngineConfig(), PAGE, 8192, "cpu", None)
    assert size.num_pages == FALLBACK_KV_CACHE_BYTES // PAGE
    assert size.reason == "fallback"
    with pytest.raises(ValueError, match="cannot hold a KV page"):
        size_kv_pool(EngineConfig(), PAGE, 8192, "cpu", FreeMemory(PAGE, "meminfo"))


@pytest.mark.parametrize("fraction", [0.0, -0.1, 0.96, 1.5])
def test_fraction_out_of_bounds_is_refused(fraction: float) -> None:
    with pytest.raises(ValueError, match="kv_cache_memory_fraction"):
        EngineConfig(kv_cache_memory_fraction=fraction)


def test_engine_sizes_its_pool_from_free_memory_and_logs_it(tiny_llama_dir: Path) -> None:
    loaded = load_model(str(tiny_llama_dir), dtype=torch.float32)
    config = EngineConfig(
        kv_cache_memory_fraction=0.5, max_num_seqs=2, max_num_batched_tokens=32, max_model_len=60
    )
    with capture_logs() as logs:
        engine = LLMEngine(loaded, config)
    # Half of this machine's free memory dwarfs two requests of 60 tokens: 2 x 4 pages.
    assert engine.num_pages == 8
    sized = next(entry for entry in logs if entry["event"] == "kv_cache_sized")
    assert sized["num_pages"] == 8
    assert sized["num_tokens"] == 8 * config.page_size
    assert sized["reason"] == "full_batch_cap"
    assert sized["free_bytes"] > 0
