"""Random interleavings of cache operations against a reference model of cached prefixes."""

from dataclasses import dataclass, field
from itertools import count

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from radix_cache import (
    FREE,
    PUBLIC_NAMESPACE,
    MatchResult,
    OutOfPagesError,
    PagePool,
    RadixPrefixCache,
    tenant_namespace,
)

PS = 2
NUM_PAGES = 12
TENANTS = [tenant_namespace(t) for t in ("a", "b", "c")]
ALL_NAMESPACES = [*TENANTS, PUBLIC_NAMESPACE]

# Shared openings make requests collide on prefixes (duplicates, splits, public hits).
token_lists = st.builds(
    lambda head, tail: [*head, *tail],
    st.sampled_from([(), (0, 0, 1, 1), (0, 0, 1, 1, 2, 2), (2, 1)]),
    st.lists(st.integers(0, 2), max_size=6),
)
tenants = st.sampled_from(TENANTS)


@dataclass
class Request:
    ns: str
    owner: str
    tokens: tuple[int, ...]  # whole pages only
    pages: list[int]  # its block table
    node: object | None  # the node it holds one lock on
    lock_ns: str  # the namespace of that node: its own or public
    locked_pages: int  # how many leading pages that lock protects
    committed: bool = False


@dataclass
class Model:
    """Per namespace: cached page-aligned prefix -> the page holding its last page."""

    cached: dict[str, dict[tuple[int, ...], int]] = field(
        default_factory=lambda: {ns: {} for ns in ALL_NAMESPACES}
    )

    def longest(self, ns: str, tokens: tuple[int, ...]) -> list[int]:
        pages = []
        for end in range(PS, len(tokens) // PS * PS + 1, PS):
            page = self.cached[ns].get(tokens[:end])
            if page is None:
                break
            pages.append(page)
        return pages


class PrefixCacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.cache = RadixPrefixCache(PagePool(NUM_PAGES), PS)
        self.model = Model()
        self.requests: list[Request] = []
        self.pinned: set[tuple[int, ...]] = set()
        self.ids = count()

    # ----- model upkeep -----
    def sync(self) -> None:
        """Drop model entries whose page left the tree; eviction only ever removes leaves."""
        owner = self.cache.pool.owner
        for ns, entries in self.model.cached.items():
            for prefix in [p for p, page in entries.items() if owner(page) != ns]:
                del entries[prefix]
            for prefix in entries:
                assert len(prefix) == PS or prefix[:-PS] in entries, (
                    "a cached prefix lost its parent"
                )
            assert self.cache.tree.stats(ns).resident_pages == len(entries)

    def check_match(self, ns: str, tokens: tuple[int, ...], allow: bool, got: MatchResult) -> None:
        expected, where = self.model.longest(ns, tokens), ns
        if allow and ns != PUBLIC_NAMESPACE:
            public = self.model.longest(PUBLIC_NAMESPACE, tokens)
            if len(public) > len(expected):
                expected, where = public, PUBLIC_NAMESPACE
        assert got.page_ids == expected
        assert got.num_tokens == len(expected) * PS
        assert (got.node is None) == (not expected)
        if expected:
            assert got.namespace == where

    def begin_request(self, ns: str, tokens: list[int], allow: bool) -> Request | None:
        full = tuple(tokens[: len(tokens) // PS * PS])
        hit = self.cache.match(ns, full, allow)
        self.check_match(ns, full, allow, hit)
        self.cache.lock(hit.node)
        need = len(full) // PS - len(hit.page_ids)
        owner = f"req:{next(self.ids)}"
        if need > self.cache.num_available_pages:
            with pytest.raises(OutOfPagesError):
                self.cache.allocate(need, owner, ns)
            self.cache.unlock(hit.node)
            return None
        pages = self.cache.allocate(need, owner, ns)
        self.sync()
        pages = hit.page_ids + pages
        return Request(ns, owner, full, pages, hit.node, hit.namespace, len(hit.page_ids))

    def commit_pages(self, req: Request, pages: list[int], cached_tokens: int) -> None:
        """Check the tree's pages after caching ``req`` and record them in the model."""
        ns = req.ns
        before = self.model.longest(ns, req.tokens)
        assert cached_tokens == len(before) * PS
        for i, (mine, tree_page) in enumerate(zip(req.pages, pages, strict=True)):
            if i < len(before):
                assert tree_page == before[i]
                if mine != tree_page:
                    assert self.cache.pool.owner(mine) == FREE, "duplicate not freed"
            else:
                assert tree_page == mine
            self.model.cached[ns][req.tokens[: (i + 1) * PS]] = tree_page

    # ----- rules -----
    @rule(ns=tenants, tokens=token_lists, allow=st.booleans())
    def begin(self, ns: str, tokens: list[int], allow: bool) -> None:
        req = self.begin_request(ns, tokens, allow)
        if req is not None:
            self.requests.append(req)

    @rule(ns=tenants, tokens=token_lists)
    def begin_twins(self, ns: str, tokens: list[int]) -> None:
        """Two identical prompts in flight at once: the second to cache holds duplicates."""
        for _ in range(2):
            self.begin(ns, tokens, allow=False)

    @precondition(lambda self: any(not r.committed for r in self.requests))
    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        req = data.draw(st.sampled_from([r for r in self.requests if not r.committed]))
        result = self.cache.cache(req.ns, req.tokens, req.pages, req.owner, req.node)
        req.committed = True
        if req.lock_ns != req.ns and req.node is not None:
            # Continuation of a public prefix: nothing changes hands.
            assert result.page_ids == req.pages and result.node is req.node
            self.sync()
            return
        self.commit_pages(req, result.page_ids, result.num_cached_tokens)
        req.pages, req.node, req.locked_pages = result.page_ids, result.node, len(req.pages)
        self.sync()
        self.check_share(req.ns)

    @precondition(lambda self: bool(self.requests))
    @rule(data=st.data())
    def end(self, data: st.DataObject) -> None:
        req = self.requests.pop(data.draw(st.integers(0, len(self.requests) - 1)))
        self.cache.unlock(req.node)
        self.cache.free([p for p in req.pages if self.cache.pool.owner(p) == req.owner])

    @rule(ns=tenants, tokens=token_lists, allow=st.booleans())
    def match(self, ns: str, tokens: list[int], allow: bool) -> None:
        self.check_match(ns, tuple(tokens), allow, self.cache.match(ns, tokens, allow))

    @rule(ns=tenants, num_pages=st.integers(0, NUM_PAGES))
    def pressure(self, ns: str, num_pages: int) -> None:
        if num_pages > self.cache.num_available_pages:
            with pytest.raises(OutOfPagesError):
                self.cache.allocate(num_pages, "req:pressure", ns)
            return
        pages = self.cache.allocate(num_pages, "req:pressure", ns)
        self.sync()
        self.cache.free(pages)

    @rule(num_pages=st.integers(1, NUM_PAGES))
    def evict(self, num_pages: int) -> None:
        evictable = self.cache.tree.num_evictable_pages
        freed = self.cache.tree.evict(num_pages)
        assert len(freed) == min(num_pages, evictable)
        self.cache.pool.free(freed)
        self.sync()

    @rule(ns=tenants, share=st.sampled_from([None, 0.0, 0.25, 0.5, 1.0]), heavy=st.booleans())
    def set_share(self, ns: str, share: float | None, heavy: bool) -> None:
        self.cache.set_share(ns, share, 2.0 if heavy else 1.0)
        self.sync()
        self.check_share(ns)

    @rule(ns=tenants, dice=st.integers(0, 3))
    def drop(self, ns: str, dice: int) -> None:
        if dice:  # a tenant leaving is rare; keep most runs' caches warm
            return
        self.cache.drop_namespace(ns)
        self.sync()
        assert self.cache.tree.stats(ns).evictable_pages == 0

    @rule(tokens=token_lists)
    def publish(self, tokens: list[int]) -> None:
        req = self.begin_request(PUBLIC_NAMESPACE, tokens, False)
        if req is None or not req.tokens:
            if req is not None:
                self.cache.unlock(req.node)
            return
        before = self.model.longest(PUBLIC_NAMESPACE, req.tokens)
        assert self.cache.publish(req.tokens, req.pages, req.owner, req.node) == len(req.tokens)
        expected = before + req.pages[len(before) :]
        self.commit_pages(req, expected, len(before) * PS)
        assert all(self.cache.pool.owner(p) != req.owner for p in req.pages)
        self.pinned.add(req.tokens)
        self.sync()

    @precondition(lambda self: bool(self.pinned))
    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        tokens = data.draw(st.sampled_from(sorted(self.pinned)))
        self.pinned.remove(tokens)
        self.cache.unpin(self.cache.match(PUBLIC_NAMESPACE, tokens).node)

    @precondition(lambda self: bool(self.pinned))
    @rule(data=st.data())
    def unpublish(self, data: st.DataObject) -> None:
        tokens = data.draw(st.sampled_from(sorted(self.pinned)))
        self.pinned.remove(tokens)
        assert self.cache.unpublish(tokens) == len(tokens)
        self.sync()
        # Nothing unpinned stays shared: only pages of pins and running requests remain public.
        assert self.cache.tree.stats(PUBLIC_NAMESPACE).evictable_pages == 0
        assert self.cache.unpublish(tokens) == 0

    # ----- invariants -----
    def check_share(self, ns: str) -> None:
        cap = self.cache.shares.cap(ns)
        stats = self.cache.tree.stats(ns)
        if cap is not None:
            assert stats.resident_pages <= max(cap, stats.locked_pages)

    @invariant()
    def integrity(self) -> None:
        self.cache.check_integrity()

    @invariant()
    def no_private_page_leaks(self) -> None:
        held = {p for r in self.requests for p in r.pages if self.cache.pool.owner(p) == r.owner}
        private = {p for p in range(NUM_PAGES) if self.cache.pool.owner(p).startswith("req:")}
        assert private == held

    @invariant()
    def locked_prefixes_stay_and_availability_is_exact(self) -> None:
        locked: set[tuple[str, tuple[int, ...]]] = set()
        holds = [(r.lock_ns, r.tokens, r.locked_pages) for r in self.requests if r.node]
        holds += [(PUBLIC_NAMESPACE, t, len(t) // PS) for t in self.pinned]
        for ns, tokens, num_pages in holds:
            for end in range(PS, num_pages * PS + 1, PS):
                assert tokens[:end] in self.model.cached[ns], "a locked prefix was evicted"
                locked.add((ns, tokens[:end]))
        cached = sum(len(entries) for entries in self.model.cached.values())
        free = sum(1 for p in range(NUM_PAGES) if self.cache.pool.owner(p) == FREE)
        assert self.cache.num_available_pages == free + cached - len(locked)


PrefixCacheMachine.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestPrefixCacheMachine = PrefixCacheMachine.TestCase
