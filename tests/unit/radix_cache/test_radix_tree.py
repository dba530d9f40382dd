"""The page-granular radix tree: matching, splitting, duplicates, LRU eviction and locks."""

import pytest

from radix_cache import CacheError, IntegrityError, RadixTree, StaleNodeError
from radix_cache.radix_node import RadixNode

PS = 2
NS = "tenant:a"


def toks(*pages: int) -> list[int]:
    """Tokens of whole pages, page ``k`` being ``[k, k]``."""
    return [t for page in pages for t in (page, page)]


def node_of(handle: object) -> RadixNode:
    assert isinstance(handle, RadixNode)
    return handle


def test_match_returns_the_longest_full_page_prefix() -> None:
    tree = RadixTree(PS)
    tree.insert(NS, toks(1, 2, 3), [10, 11, 12])
    result = tree.match_prefix(NS, [*toks(1, 2, 3), 4])  # a trailing partial page is ignored
    assert result.page_ids == [10, 11, 12]
    assert result.num_tokens == 6
    assert tree.match_prefix(NS, toks(5)).node is None
    assert tree.match_prefix(NS, [1]).page_ids == []
    tree.check_integrity()


def test_partial_match_splits_at_the_page_boundary() -> None:
    tree = RadixTree(PS)
    tree.insert(NS, toks(1, 2, 3), [10, 11, 12])
    result = tree.match_prefix(NS, toks(1, 2, 9))
    assert result.page_ids == [10, 11]
    head = node_of(result.node)
    assert head.page_ids == [10, 11] and len(head.children) == 1
    # A mismatch inside a page counts as no match for that page.
    assert tree.match_prefix(NS, [*toks(1), 2, 7]).page_ids == [10]
    assert tree.match_prefix(NS, toks(1, 2, 3)).page_ids == [10, 11, 12]
    tree.check_integrity()


def test_insert_reports_what_was_cached_and_returns_the_tree_pages() -> None:
    tree = RadixTree(PS)
    tree.insert(NS, toks(1, 2), [10, 11])
    result = tree.insert(NS, toks(1, 2, 3), [20, 21, 22])
    assert result.num_cached_tokens == 4
    assert result.page_ids == [10, 11, 22]
    branch = tree.insert(NS, toks(1, 5), [30, 31])  # diverges inside the cached edge
    assert (branch.num_cached_tokens, branch.page_ids) == (2, [10, 31])
    assert tree.num_resident_pages == 4
    with pytest.raises(ValueError):
        tree.insert(NS, toks(1), [1, 2])
    tree.check_integrity()


def test_namespaces_never_see_each_other() -> None:
    tree = RadixTree(PS)
    tree.insert("tenant:a", toks(1, 2), [10, 11])
    assert tree.match_prefix("tenant:b", toks(1, 2)).page_ids == []
    other = tree.insert("tenant:b", toks(1, 2), [20, 21])
    assert other.num_cached_tokens == 0 and other.page_ids == [20, 21]
    assert tree.stats("tenant:a").resident_pages == 2
    assert tree.stats("tenant:b").resident_pages == 2


def test_evict_takes_least_recently_used_leaves_first() -> None:
    tree = RadixTree(PS)
    tree.insert(NS, toks(1), [10])
    tree.insert(NS, toks(2), [20])
    tree.insert(NS, toks(3), [30])
    tree.match_prefix(NS, toks(1))  # 1 becomes the most recently used
    assert tree.evict(1) == [20]
    assert tree.evict(1) == [30]
    assert tree.evict(5) == [10]
    assert tree.num_resident_pages == 0
    tree.check_integrity()


def test_evict_trims_a_leaf_from_its_tail_then_reaches_the_parent() -> None:
    tree = RadixTree(PS)
    tree.insert(NS, toks(1, 2, 3), [10, 11, 12])
    tree.insert(NS, toks(1, 4), [10, 40])
    tree.match_prefix(NS, toks(1, 4))
    assert tree.evict(1) == [12]  # only the tail page of the older leaf goes
    assert tree.match_prefix(NS, toks(1, 2, 3)).page_ids == [10, 11]
    tree.match_prefix(NS, toks(1, 4))
    assert tree.evict(1) == [11]
    assert tree.evict(2) == [40, 10]
    tree.check_integrity()


def test_locks_protect_the_node_and_its_ancestors() -> None:
    tree = RadixTree(PS)
    tree.insert(NS, toks(1, 2), [10, 11])
    deep = tree.insert(NS, toks(1, 2, 3), [10, 11, 12]).node
    tree.insert(NS, toks(7), [70])
    tree.lock(node_of(deep))
    tree.lock(node_of(deep))
    assert tree.num_locked_pages == 3 and tree.num_evictable_pages == 1
    assert tree.evict(10) == [70]
    tree.unlock(node_of(deep))
    assert tree.evict(10) == []  # still one lock held
    tree.unlock(node_of(deep))
    assert sorted(tree.evict(10)) == [10, 11, 12]
    tree.check_integrity()


def test_stale_and_unlocked_handles_raise() -> None:
    tree = RadixTree(PS)
    node = node_of(tree.insert(NS, toks(1), [10]).node)
    with pytest.raises(CacheError):
        tree.unlock(node)
    tree.evict(1)
    with pytest.raises(StaleNodeError):
        tree.lock(node)


def test_per_namespace_counters_follow_inserts_locks_and_evictions() -> None:
    tree = RadixTree(PS)
    node = node_of(tree.insert(NS, toks(1, 2), [10, 11]).node)
    tree.insert("public", toks(3), [30])
    tree.lock(node)
    stats = tree.stats(NS)
    assert (stats.resident_pages, stats.locked_pages, stats.evictable_pages) == (2, 2, 0)
    tree.unlock(node)
    tree.evict(1, namespace=NS)
    assert (tree.stats(NS).resident_pages, tree.stats(NS).evicted_pages) == (1, 1)
    assert tree.stats("public").resident_pages == 1


def test_drop_namespace_frees_unlocked_pages_and_forgets_it() -> None:
    tree = RadixTree(PS)
    tree.insert(NS, toks(1, 2), [10, 11])
    assert sorted(tree.drop_namespace(NS)) == [10, 11]
    assert NS not in tree.namespaces()
    tree.check_integrity()


def test_heaps_stay_bounded_under_repeated_matches() -> None:
    tree = RadixTree(PS)
    tree.insert(NS, toks(1), [10])
    for _ in range(500):
        tree.match_prefix(NS, toks(1))
    heap = tree._lru.heap(None)
    assert heap is not None and len(heap) < 100
    tree.check_integrity()
    assert tree.evict(1) == [10]


def test_check_integrity_detects_a_broken_lock_count() -> None:
    tree = RadixTree(PS)
    node = node_of(tree.insert(NS, toks(1, 2), [10, 11]).node)
    node.lock_ref = 1
    with pytest.raises(IntegrityError):
        tree.check_integrity()


def test_check_integrity_detects_a_page_in_two_places() -> None:
    tree = RadixTree(PS)
    tree.insert(NS, toks(1), [10])
    tree.insert(NS, toks(2), [10])
    with pytest.raises(IntegrityError):
        tree.check_integrity()
