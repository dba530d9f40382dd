"""Per-namespace cache statistics: residency, locks, queries and hits (for hit-rate reports)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


@dataclass(slots=True)
class NamespaceStats:
    """Live counters of one namespace, kept by the radix tree."""

    resident_pages: int = 0  # pages of the namespace held by the tree
    locked_pages: int = 0  # of those, pages of nodes with lock_ref > 0
    queries: int = 0  # match calls made for the namespace
    queried_tokens: int = 0  # tokens offered to those matches
    hit_tokens: int = 0  # tokens served from the cache (own or public)
    public_hit_tokens: int = 0  # of those, tokens served from the public namespace
    evicted_pages: int = 0  # pages evicted from the namespace since it appeared

    @property
    def evictable_pages(self) -> int:
        return self.resident_pages - self.locked_pages


class NamespaceSnapshot(NamedTuple):
    """A copy of one namespace's numbers with its share settings, for engine reports."""

    namespace: str
    resident_pages: int
    locked_pages: int
    share: float | None  # fraction of cacheable pages it may keep; None is unlimited
    weight: float
    cap_pages: int | None  # share × cacheable pages, rounded down
    queries: int
    queried_tokens: int
    hit_tokens: int
    public_hit_tokens: int
    evicted_pages: int

    @property
    def hit_rate(self) -> float:
        """Share of queried tokens served from the cache (0.0 before any query)."""
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0
