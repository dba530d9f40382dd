"""Lazy min-heaps of evictable leaves ordered by last access, globally and per namespace."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable

from radix_cache.radix_node import RadixNode


class LruHeap:
    """Entries ``(last_access, seq, node)``; an entry is live while the node is an evictable leaf
    with that very access time. Stale entries are skipped when popped.
    """

    __slots__ = ("_entries", "_seq")

    def __init__(self) -> None:
        self._entries: list[tuple[int, int, RadixNode]] = []
        self._seq = itertools.count()  # tie-breaker: nodes themselves are never compared

    def __len__(self) -> int:
        return len(self._entries)

    def push(self, node: RadixNode) -> None:
        heapq.heappush(self._entries, (node.last_access, next(self._seq), node))

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


class LruIndex:
    """One heap over every namespace (plain LRU) and one per namespace (its own LRU).

    Whoever changes a node pushes it when it becomes, or stays with a new access time, an
    evictable leaf, so every evictable leaf has a live entry in both heaps. Stale entries are
    dropped by a rebuild once pushes outnumber twice the nodes, keeping the heaps O(nodes).
    """

    __slots__ = ("_all", "_by_namespace", "_pushes")

    def __init__(self) -> None:
        self._all = LruHeap()
        self._by_namespace: dict[str, LruHeap] = {}
        self._pushes = 0

    def add_namespace(self, namespace: str) -> None:
        self._by_namespace.setdefault(namespace, LruHeap())

    def drop_namespace(self, namespace: str) -> None:
        del self._by_namespace[namespace]

    def heap(self, namespace: str | None) -> LruHeap | None:
        return self._all if namespace is None else self._by_namespace.get(namespace)

    def push(self, node: RadixNode, num_nodes: int) -> bool:
        """Index ``node``; True when the caller should ``rebuild`` (stale entries pile up)."""
        self._all.push(node)
        self._by_namespace[node.namespace].push(node)
        self._pushes += 1
        return self._pushes > 2 * num_nodes + 64

    def rebuild(self, nodes: Iterable[RadixNode]) -> None:
        self._all.clear()
        for heap in self._by_namespace.values():
            heap.clear()
        self._pushes = 0
        for node in nodes:
            if node.is_evictable_leaf:
                self._all.push(node)
                self._by_namespace[node.namespace].push(node)
                self._pushes += 1
