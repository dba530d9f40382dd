"""KV caches on transparent huge pages: the advice is taken where Linux offers them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from engine.attention.backend import allocate_kv_caches
from engine.device import HUGE_PAGE_BYTES, advise_huge_pages, zeros_on_huge_pages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
THP_ON = THP.is_file() and "[never]" not in THP.read_text()


def huge_bytes_at(address: int) -> int:
    """AnonHugePages of the mapping of this process that holds ``address`` (Linux smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1]) * 1024
    return 0


def test_small_tensors_and_other_platforms_are_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not advise_huge_pages(torch.empty(HUGE_PAGE_BYTES, dtype=torch.uint8))
    monkeypatch.setattr(sys, "platform", "darwin")
    assert not advise_huge_pages(torch.empty(8 * HUGE_PAGE_BYTES, dtype=torch.uint8))


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or not THP_ON,
    reason="needs Linux with transparent huge pages not set to never (elsewhere the advice is "
    "skipped, tested above)",
)
def test_kv_caches_are_backed_by_huge_pages() -> None:
    """A 72 MiB layer cache, in memory of its own advised before anything touches it, faults
    in as 2 MiB pages: all but the partial huge pages at its two ends is AnonHugePages."""
    caches = allocate_kv_caches(2, 6144, 16, 3, 64, torch.bfloat16)
    for cache in caches:
        size = cache.numel() * cache.element_size()
        assert bool(cache.eq(0).all())
        assert huge_bytes_at(cache.data_ptr() + size // 2) >= size - 2 * HUGE_PAGE_BYTES


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or not THP_ON,
    reason="needs Linux with transparent huge pages not set to never",
)
def test_huge_pages_are_had_after_malloc_has_handed_memory_back() -> None:
    """After malloc has handed memory out and taken it back (many 1 MiB tensors freed together,
    which coalesce into one free run of the heap that torch's allocator may hand out again on
    its 4 KiB pages), the fresh mapping still gets huge pages, comes zeroed, and lives as long
    as any tensor over it."""
    junk = [torch.ones(2**20, dtype=torch.uint8) for _ in range(96)]
    del junk
    t = zeros_on_huge_pages((48, HUGE_PAGE_BYTES // 4), torch.float32)
    size = t.numel() * t.element_size()
    assert t.data_ptr() % HUGE_PAGE_BYTES == 0 and bool(t.eq(0).all())
    t.fill_(2.0)  # memory is given (as huge pages) where it is first written
    assert huge_bytes_at(t.data_ptr() + size // 2) >= size - 2 * HUGE_PAGE_BYTES
    view = t[1:3]
    del t
    assert float(view.sum()) == 2.0 * view.numel()  # the mapping outlives its first tensor


def test_small_zeroed_tensors_come_from_torch() -> None:
    t = zeros_on_huge_pages((3, 5), torch.bfloat16)
    assert t.shape == (3, 5) and t.dtype == torch.bfloat16 and bool(t.eq(0).all())
