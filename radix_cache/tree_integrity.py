"""The radix tree's invariant checker: structure, lock counts, page accounting, LRU heaps."""

from __future__ import annotations

from collections.abc import Mapping

from radix_cache.errors import IntegrityError
from radix_cache.lru_heap import LruIndex
from radix_cache.radix_node import RadixNode
from radix_cache.stats import NamespaceStats


def check_tree(
    *,
    page_size: int,
    roots: Mapping[str, RadixNode],
    stats: Mapping[str, NamespaceStats],
    lru: LruIndex,
    totals: tuple[int, int, int],
) -> None:
    """Raise IntegrityError on the first broken invariant; ``totals`` is the tree's counters
    ``(resident pages, locked pages, non-root nodes)``. Linear in the tree and heap sizes.
    """
    seen_pages: dict[int, str] = {}
    live_all = lru.heap(None)
    live_global = live_all.live_nodes() if live_all is not None else set()
    resident_total = locked_total = nodes_total = 0
    for namespace, root in roots.items():
        if root.namespace != namespace or not root.is_root or root.page_ids or root.tokens:
            raise IntegrityError(f"bad root for namespace {namespace!r}")
        if root.direct_locks or not root.attached:
            raise IntegrityError(f"root of {namespace!r} is locked directly or detached")
        ns_heap = lru.heap(namespace)
        if namespace not in stats or ns_heap is None:
            raise IntegrityError(f"namespace {namespace!r} lacks stats or a heap")
        live_ns = ns_heap.live_nodes()
        resident = locked = 0
        stack = [root]
        while stack:
            node = stack.pop()
            _check_node(node, namespace, page_size)
            for page in node.page_ids:
                if page in seen_pages:
                    raise IntegrityError(f"page {page} sits in two places")
                seen_pages[page] = namespace
            resident += len(node.page_ids)
            if node.lock_ref:
                locked += len(node.page_ids)
            if node.is_evictable_leaf and not (id(node) in live_global and id(node) in live_ns):
                raise IntegrityError(f"evictable leaf of {namespace!r} missing from an LRU heap")
            nodes_total += 0 if node.is_root else 1
            stack.extend(node.children.values())
        counted = stats[namespace]
        if (counted.resident_pages, counted.locked_pages) != (resident, locked):
            raise IntegrityError(
                f"{namespace!r}: counted {counted.resident_pages} resident /"
                f" {counted.locked_pages} locked, found {resident} / {locked}"
            )
        resident_total += resident
        locked_total += locked
    if (resident_total, locked_total, nodes_total) != totals:
        raise IntegrityError(
            f"tree totals {totals} disagree with {(resident_total, locked_total, nodes_total)}"
        )


def _check_node(node: RadixNode, namespace: str, page_size: int) -> None:
    if not node.attached or node.namespace != namespace:
        raise IntegrityError("a detached or foreign node is reachable")
    if not node.is_root and (
        not node.page_ids or len(node.tokens) != len(node.page_ids) * page_size
    ):
        raise IntegrityError("a node's edge is not a whole number of pages")
    if node.direct_locks < 0 or node.lock_ref < node.direct_locks:
        raise IntegrityError("negative lock count")
    child_locks = 0
    for key, child in node.children.items():
        if child.parent is not node or child.tokens[:page_size] != key:
            raise IntegrityError("a child is filed under the wrong key or parent")
        if child.last_access > node.last_access:
            raise IntegrityError("a child was used more recently than its parent")
        child_locks += child.lock_ref
    if node.lock_ref != node.direct_locks + child_locks:
        raise IntegrityError(
            f"lock_ref {node.lock_ref} != own {node.direct_locks} + children {child_locks}"
        )
