"""Time a prefix cache's match and insert calls from the outside, without touching the engine."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from radix_cache.prefix_cache import PrefixCache


@dataclass(slots=True)
class CacheTimer:
    """Cumulative seconds and calls of ``match`` and ``cache`` (insert) on one cache object."""

    match_s: float = 0.0
    insert_s: float = 0.0
    num_match: int = 0
    num_insert: int = 0

    def install(self, cache: PrefixCache) -> None:
        """Shadow the bound methods with timed wrappers on this instance only."""
        cache.match = self._wrap(cache.match, "match")  # type: ignore[method-assign]
        cache.cache = self._wrap(cache.cache, "insert")  # type: ignore[method-assign]

    def _wrap(self, method: Callable[..., Any], kind: str) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                if kind == "match":
                    self.match_s += elapsed
                    self.num_match += 1
                else:
                    self.insert_s += elapsed
                    self.num_insert += 1

        return timed

    def reset(self) -> None:
        self.match_s = self.insert_s = 0.0
        self.num_match = self.num_insert = 0
