"""The page-granular radix tree of cached prefixes, one subtree per namespace, with LRU eviction."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import NamedTuple

from radix_cache.errors import CacheError, StaleNodeError
from radix_cache.lru_heap import LruIndex
from radix_cache.prefix_cache import MatchResult
from radix_cache.radix_node import RadixNode
from radix_cache.stats import NamespaceStats
from radix_cache.tree_integrity import check_tree


class TreeInsert(NamedTuple):
    page_ids: list[int]  # the tree's pages for all inserted tokens
    num_cached_tokens: int  # tokens the tree already held: the caller's pages there are duplicates
    node: RadixNode | None  # deepest node covering the tokens (not locked); None for no pages


class RadixTree:
    """Cached full pages of token ids keyed by content, in per-namespace subtrees.

    Mutation rules: ``match_prefix`` only splits nodes (at page boundaries) and refreshes access
    times; ``insert`` adds pages the caller hands over; ``evict`` removes pages of unlocked leaves,
    least recently used first, trimming a leaf from its tail; ``lock``/``unlock`` count locks from
    a node up to its namespace root. A node with ``lock_ref > 0`` is never evicted or trimmed.
    Pages are opaque ids; the caller returns evicted ones to its pool. Not thread-safe.
    """

    __slots__ = ("_clock", "_lru", "_num_nodes", "_roots", "_stats", "_totals", "page_size")

    def __init__(self, page_size: int) -> None:
        if page_size <= 0:
            raise ValueError("page_size must be positive")
        self.page_size = page_size
        self._roots: dict[str, RadixNode] = {}
        self._stats: dict[str, NamespaceStats] = {}
        self._lru = LruIndex()
        self._clock = itertools.count(1)  # logical time of matches and inserts
        self._num_nodes = 0  # non-root nodes
        self._totals = NamespaceStats()  # resident and locked pages of all namespaces

    @property
    def num_resident_pages(self) -> int:
        return self._totals.resident_pages

    @property
    def num_locked_pages(self) -> int:
        return self._totals.locked_pages

    @property
    def num_evictable_pages(self) -> int:
        return self._totals.evictable_pages

    def namespaces(self) -> list[str]:
        return list(self._roots)

    def stats(self, namespace: str) -> NamespaceStats:
        """The namespace's live counters (a zeroed object for a namespace never seen)."""
        return self._stats.get(namespace) or NamespaceStats()

    def all_stats(self) -> Mapping[str, NamespaceStats]:
        return self._stats

    def record_query(self, namespace: str, queried: int, hit: int, public_hit: int = 0) -> None:
        stats = self._stats.setdefault(namespace, NamespaceStats())
        stats.queries += 1
        stats.queried_tokens += queried
        stats.hit_tokens += hit
        stats.public_hit_tokens += public_hit

    def match_prefix(self, namespace: str, tokens: Sequence[int]) -> MatchResult:
        """Longest cached full-page prefix of ``tokens`` in ``namespace``; never looks elsewhere.

        Splits a node when the match ends inside its edge so the handle covers exactly the match.
        Cost is proportional to the matched length (plus one page).
        """
        root = self._roots.get(namespace)
        if root is None:
            return MatchResult([], 0, None, namespace)
        node, num_pages, page_ids = self._walk(root, tokens, len(tokens) // self.page_size)
        if node is root:
            return MatchResult([], 0, None, namespace)
        self._touch(node, next(self._clock))
        return MatchResult(page_ids, num_pages * self.page_size, node, namespace)

    def insert(self, namespace: str, tokens: Sequence[int], page_ids: Sequence[int]) -> TreeInsert:
        """Cache ``tokens`` (exactly ``len(page_ids)`` full pages) whose KV lives in ``page_ids``.

        Pages of the already cached part stay the tree's (the caller's copies there are
        duplicates); the rest are adopted. The new deepest node is returned unlocked.
        """
        num_pages = len(page_ids)
        if len(tokens) != num_pages * self.page_size:
            raise ValueError(f"{len(tokens)} tokens are not {num_pages} full pages")
        if not num_pages:
            return TreeInsert([], 0, None)
        root = self._roots.get(namespace)
        if root is None:
            root = self._roots[namespace] = RadixNode(namespace, (), [], None)
            self._lru.add_namespace(namespace)
            self._stats.setdefault(namespace, NamespaceStats())
        node, cached, tree_pages = self._walk(root, tokens, num_pages)
        stamp = next(self._clock)
        if cached < num_pages:
            ps = self.page_size
            leaf = RadixNode(namespace, tuple(tokens[cached * ps :]), list(page_ids[cached:]), node)
            node.children[leaf.tokens[:ps]] = leaf
            self._num_nodes += 1
            self._add_resident(namespace, num_pages - cached)
            tree_pages.extend(leaf.page_ids)
            node = leaf
        self._touch(node, stamp)
        return TreeInsert(tree_pages, cached * self.page_size, node)

    def _walk(
        self, root: RadixNode, tokens: Sequence[int], num_pages: int
    ) -> tuple[RadixNode, int, list[int]]:
        """Follow ``tokens`` down from ``root``: (deepest node, matched pages, their page ids)."""
        ps = self.page_size
        node, matched, page_ids = root, 0, []
        while matched < num_pages:
            child = node.children.get(tuple(tokens[matched * ps : (matched + 1) * ps]))
            if child is None:
                break
            common = self._common_pages(child, tokens, matched, num_pages - matched)
            if common < len(child.page_ids):
                child = self._split(child, common)
            page_ids.extend(child.page_ids)
            node, matched = child, matched + common
        return node, matched, page_ids

    def _common_pages(self, node: RadixNode, tokens: Sequence[int], start: int, limit: int) -> int:
        ps, edge = self.page_size, node.tokens
        limit = min(limit, len(node.page_ids))
        base = start * ps
        if tuple(tokens[base : base + limit * ps]) == edge[: limit * ps]:
            return limit
        common = 1  # the first page matched by the child's key
        while (
            tuple(tokens[base + common * ps : base + (common + 1) * ps])
            == edge[common * ps : (common + 1) * ps]
        ):
            common += 1
        return common

    def _split(self, node: RadixNode, num_pages: int) -> RadixNode:
        """Cut ``node`` after ``num_pages``: a new head node takes them, ``node`` keeps the tail."""
        ps, parent = self.page_size, node.parent
        if parent is None or not 0 < num_pages < len(node.page_ids):
            raise CacheError("split outside a node's edge")
        head = RadixNode(
            node.namespace,
            node.tokens[: num_pages * ps],
            node.page_ids[:num_pages],
            parent,
            lock_ref=node.lock_ref,
            last_access=node.last_access,
        )
        parent.children[head.tokens[:ps]] = head
        node.tokens = node.tokens[num_pages * ps :]
        node.page_ids = node.page_ids[num_pages:]
        node.parent = head
        head.children[node.tokens[:ps]] = node
        self._num_nodes += 1
        return head

    def _touch(self, node: RadixNode, stamp: int) -> None:
        """Refresh access times from ``node`` up to its root (keeps parents no older than kids)."""
        walker: RadixNode | None = node
        while walker is not None:
            walker.last_access = stamp
            walker = walker.parent
        if node.is_evictable_leaf:
            self._push(node)

    def lock(self, node: RadixNode) -> None:
        """Take one counted lock on ``node``; it and its ancestors become unevictable."""
        self._check_handle(node)
        node.direct_locks += 1
        walker: RadixNode | None = node
        while walker is not None:
            if walker.lock_ref == 0:
                self._add_locked(walker.namespace, len(walker.page_ids))
            walker.lock_ref += 1
            walker = walker.parent

    def unlock(self, node: RadixNode) -> None:
        """Release one lock taken by ``lock(node)``."""
        self._check_handle(node)
        if node.direct_locks <= 0:
            raise CacheError("unlock of a node that holds no lock")
        node.direct_locks -= 1
        walker: RadixNode | None = node
        while walker is not None:
            walker.lock_ref -= 1
            if walker.lock_ref == 0:
                self._add_locked(walker.namespace, -len(walker.page_ids))
                if walker.is_evictable_leaf:
                    self._push(walker)
            walker = walker.parent

    def _check_handle(self, node: RadixNode) -> None:
        if not node.attached:
            raise StaleNodeError("node was evicted; lock it right after match")
        if node.is_root or self._roots.get(node.namespace) is not node.path_root():
            raise CacheError("not a node of this tree")

    # ----- eviction -----
    def evict(
        self,
        num_pages: int,
        namespace: str | None = None,
        skip: Callable[[str], bool] | None = None,
        max_leaves: int | None = None,
    ) -> list[int]:
        """Remove up to ``num_pages`` pages of unlocked leaves, least recently used first.

        ``namespace`` limits it to one namespace; ``skip(ns)`` passes over namespaces it names;
        ``max_leaves`` bounds how many leaves are touched. Returns the freed page ids (maybe fewer
        than asked). A leaf larger than what is left to free loses only its tail pages.
        """
        heap = self._lru.heap(namespace)
        freed: list[int] = []
        if heap is None:
            return freed
        skipped: list[RadixNode] = []
        leaves = 0
        while len(freed) < num_pages and (max_leaves is None or leaves < max_leaves):
            leaf = heap.pop()
            if leaf is None:
                break
            if skip is not None and skip(leaf.namespace):
                skipped.append(leaf)
                continue
            freed.extend(self._evict_tail(leaf, num_pages - len(freed)))
            leaves += 1
        for leaf in skipped:
            heap.push(leaf)
        return freed

    def _evict_tail(self, leaf: RadixNode, num_pages: int) -> list[int]:
        if num_pages < len(leaf.page_ids):
            self._split(leaf, len(leaf.page_ids) - num_pages)
        parent = leaf.parent
        if parent is None:
            raise CacheError("cannot evict a namespace root")
        del parent.children[leaf.tokens[: self.page_size]]
        leaf.attached = False
        self._num_nodes -= 1
        self._add_resident(leaf.namespace, -len(leaf.page_ids))
        self._stats[leaf.namespace].evicted_pages += len(leaf.page_ids)
        if parent.is_evictable_leaf:
            self._push(parent)
        return leaf.page_ids

    def drop_namespace(self, namespace: str) -> list[int]:
        """Evict every unlocked page of ``namespace``; forget it once nothing of it is left."""
        freed = self.evict(self.stats(namespace).resident_pages, namespace=namespace)
        root = self._roots.get(namespace)
        if root is not None and not root.children:
            del self._roots[namespace], self._stats[namespace]
            self._lru.drop_namespace(namespace)
        return freed

    def _push(self, node: RadixNode) -> None:
        if self._lru.push(node, self._num_nodes):
            self._lru.rebuild(self.iter_nodes())

    def _add_resident(self, namespace: str, num_pages: int) -> None:
        self._stats[namespace].resident_pages += num_pages
        self._totals.resident_pages += num_pages

    def _add_locked(self, namespace: str, num_pages: int) -> None:
        self._stats[namespace].locked_pages += num_pages
        self._totals.locked_pages += num_pages

    def iter_nodes(self, namespace: str | None = None) -> Iterator[RadixNode]:
        """Every non-root node (of one namespace, or all), parents before children."""
        roots = self._roots.values() if namespace is None else [self._roots[namespace]]
        stack = [child for root in roots for child in root.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def check_integrity(self) -> None:
        """Verify structure, lock counts, page accounting and the LRU heaps; raises on a bug."""
        totals = (self._totals.resident_pages, self._totals.locked_pages, self._num_nodes)
        check_tree(
            page_size=self.page_size,
            roots=self._roots,
            stats=self._stats,
            lru=self._lru,
            totals=totals,
        )
