"""Per-tenant cache shares: each namespace's cap of resident pages and who is furthest over it.

A namespace with ``share`` may keep ``floor(share × cacheable pages)``; excess is weighed by weight.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class CacheShare:
    share: float | None  # fraction of cacheable pages; None is unlimited
    weight: float  # a heavier namespace counts as less over for the same excess


class SharePolicy:
    """The share settings of every namespace; pure arithmetic, no pages."""

    __slots__ = ("_shares", "cacheable_pages")

    def __init__(self, cacheable_pages: int) -> None:
        if cacheable_pages < 0:
            raise ValueError("cacheable_pages must not be negative")
        self.cacheable_pages = cacheable_pages
        self._shares: dict[str, CacheShare] = {}

    def set_share(self, namespace: str, share: float | None, weight: float = 1.0) -> None:
        """Set (or with ``share=None`` and the default weight, clear) a namespace's share."""
        if share is not None and not (math.isfinite(share) and 0.0 <= share <= 1.0):
            raise ValueError(f"share must be within [0, 1], not {share}")
        if not (math.isfinite(weight) and weight > 0.0):
            raise ValueError(f"weight must be positive, not {weight}")
        if share is None and weight == 1.0:
            self._shares.pop(namespace, None)
        else:
            self._shares[namespace] = CacheShare(share, weight)

    def get(self, namespace: str) -> CacheShare:
        return self._shares.get(namespace) or CacheShare(None, 1.0)

    def cap(self, namespace: str) -> int | None:
        """Most pages ``namespace`` may keep resident; None when unlimited."""
        share = self.get(namespace).share
        return None if share is None else math.floor(share * self.cacheable_pages)

    def excess(self, namespace: str, resident_pages: int) -> int:
        """Pages held beyond the cap (0 when within it or unlimited)."""
        cap = self.cap(namespace)
        return 0 if cap is None else max(0, resident_pages - cap)

    def is_protected(self, namespace: str, resident_pages: int) -> bool:
        """Within a set share: other namespaces' demand takes these pages only as a last resort."""
        cap = self.cap(namespace)
        return cap is not None and resident_pages <= cap

    def capped_namespaces(self) -> list[str]:
        return [ns for ns, setting in self._shares.items() if setting.share is not None]

    def furthest_over(
        self, resident_of: Callable[[str], int], evictable_of: Callable[[str], int]
    ) -> str | None:
        """The capped namespace with the largest weighted excess that has evictable pages."""
        best: str | None = None
        best_score = 0.0
        for namespace in self.capped_namespaces():
            excess = self.excess(namespace, resident_of(namespace))
            if excess <= 0 or evictable_of(namespace) <= 0:
                continue
            score = excess / self.get(namespace).weight
            if score > best_score:
                best, best_score = namespace, score
        return best
