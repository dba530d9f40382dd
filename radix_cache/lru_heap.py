"""A lazy min-heap of evictable leaves ordered by last access (stale entries skipped on pop)."""

from __future__ import annotations

import heapq

from radix_cache.radix_node import RadixNode


class LruHeap:
    """Entries ``(last_access, seq, node)``; an entry is live while the node is an evictable leaf
    with that very access time. Whoever changes a node's state pushes a fresh entry when the node
    becomes (or stays, with a new time) an evictable leaf, so every evictable leaf has a live one.
    """

    __slots__ = ("_entries",)

    def __init__(self) -> None:
        self._entries: list[tuple[int, int, RadixNode]] = []

    def __len__(self) -> int:
        return len(self._entries)

    def push(self, node: RadixNode, seq: int) -> None:
        heapq.heappush(self._entries, (node.last_access, seq, node))

    def pop(self) -> RadixNode | None:
        """The least recently used evictable leaf, or None; O(log n) amortized."""
        entries = self._entries
        while entries:
            stamp, _, node = heapq.heappop(entries)
            if node.is_evictable_leaf and node.last_access == stamp:
                return node
        return None

    def clear(self) -> None:
        self._entries.clear()

    def live_nodes(self) -> set[int]:
        """Ids of nodes holding a live entry (for integrity checks)."""
        return {
            id(node)
            for stamp, _, node in self._entries
            if node.is_evictable_leaf and node.last_access == stamp
        }
