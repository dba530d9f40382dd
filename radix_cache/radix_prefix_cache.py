"""The engine's prefix cache: page pool, namespaced radix tree and per-tenant shares together."""

from __future__ import annotations

from collections.abc import Sequence

from radix_cache.errors import (
    CacheError,
    IntegrityError,
    IsolationError,
    OutOfPagesError,
    PageOwnershipError,
    StaleNodeError,
)
from radix_cache.page_pool import FREE, PagePool
from radix_cache.prefix_cache import (
    PUBLIC_NAMESPACE,
    InsertResult,
    MatchResult,
    PrefixCache,
    tenant_namespace,
)
from radix_cache.radix_node import RadixNode
from radix_cache.radix_tree import RadixTree
from radix_cache.shares import SharePolicy
from radix_cache.stats import NamespaceSnapshot

_TENANT_PREFIX = tenant_namespace("")


def _is_namespace_tag(tag: str) -> bool:
    return tag == PUBLIC_NAMESPACE or tag.startswith(_TENANT_PREFIX)


class RadixPrefixCache(PrefixCache):
    """Prefix caching with one radix subtree per tenant, a public subtree and cache shares.

    Mutation rules: ``match`` splits nodes and refreshes access times only; ``cache`` moves the
    request's new full pages to the tree (pool owner becomes the namespace) and frees its
    duplicates; ``allocate`` may evict unlocked cached pages; ``pin``/``unpin`` hold a lock on a
    public node for the cache itself, so published prefixes are never evicted (``unpublish``
    releases a prefix's pin and frees the public pages nobody holds). Locks are counted
    per handle; every ``lock`` needs one ``unlock``. Eviction order when pages are needed: the
    requester's own pages beyond its share, then the namespaces furthest over their shares
    (weighted), then plain LRU over pages not protected by a share, and only as a last resort
    pages of other namespaces within their share, so ``num_available_pages`` is exact.
    Not thread-safe: the engine thread alone calls it.
    """

    def __init__(self, pool: PagePool, page_size: int, cacheable_pages: int | None = None) -> None:
        super().__init__(pool, page_size)
        self.tree = RadixTree(page_size)
        self.shares = SharePolicy(pool.num_pages if cacheable_pages is None else cacheable_pages)
        self._pins: dict[RadixNode, int] = {}

    @property
    def num_available_pages(self) -> int:
        return self.pool.num_free_pages + self.tree.num_evictable_pages

    def can_allocate(self, num_pages: int) -> bool:
        return num_pages <= self.num_available_pages

    def set_share(self, namespace: str, share: float | None, weight: float = 1.0) -> None:
        """Let ``namespace`` keep at most ``share × cacheable pages``; trims it at once."""
        self.shares.set_share(namespace, share, weight)
        self._enforce_share(namespace)

    # ----- matching and locks -----
    def match(
        self, namespace: str, tokens: Sequence[int], allow_public: bool = True
    ) -> MatchResult:
        best = self.tree.match_prefix(namespace, tokens)
        public_hit = 0
        full_tokens = len(tokens) // self.page_size * self.page_size
        if allow_public and namespace != PUBLIC_NAMESPACE and best.num_tokens < full_tokens:
            shared = self.tree.match_prefix(PUBLIC_NAMESPACE, tokens)
            if shared.num_tokens > best.num_tokens:
                best, public_hit = shared, shared.num_tokens
        self.tree.record_query(namespace, len(tokens), best.num_tokens, public_hit)
        return best

    def lock(self, node: object | None) -> None:
        if node is not None:
            self.tree.lock(self._node(node))

    def unlock(self, node: object | None) -> None:
        if node is not None:
            self.tree.unlock(self._node(node))

    # ----- pages -----
    def allocate(self, num_pages: int, owner: str, namespace: str) -> list[int]:
        if num_pages < 0:
            raise ValueError("num_pages must not be negative")
        if not owner or _is_namespace_tag(owner):
            raise PageOwnershipError(f"owner {owner!r} is not a request tag")
        if num_pages > self.num_available_pages:
            raise OutOfPagesError(f"need {num_pages} pages, {self.num_available_pages} available")
        self._enforce_share(namespace)
        need = num_pages - self.pool.num_free_pages
        if need > 0:
            self._make_room(need, namespace)
        return self.pool.allocate(num_pages, owner)

    def _make_room(self, need: int, requester: str) -> None:
        tree, shares = self.tree, self.shares

        def resident(ns: str) -> int:
            return tree.stats(ns).resident_pages

        def evictable(ns: str) -> int:
            return tree.stats(ns).evictable_pages

        def protected(ns: str) -> bool:
            return ns != requester and shares.is_protected(ns, resident(ns))

        while need > 0:
            victim = shares.furthest_over(resident, evictable)
            if victim is None:
                break
            take = min(need, shares.excess(victim, resident(victim)))
            need -= self._release(tree.evict(take, namespace=victim, max_leaves=1))
        if need > 0:
            need -= self._release(tree.evict(need, skip=protected))
        if need > 0:
            need -= self._release(tree.evict(need))
        if need > 0:
            raise IntegrityError(f"eviction fell {need} pages short of the available count")

    def _enforce_share(self, namespace: str) -> None:
        excess = self.shares.excess(namespace, self.tree.stats(namespace).resident_pages)
        if excess:
            self._release(self.tree.evict(excess, namespace=namespace))

    def _release(self, page_ids: list[int]) -> int:
        self.pool.free(page_ids)
        return len(page_ids)

    def cache(
        self,
        namespace: str,
        tokens: Sequence[int],
        page_ids: Sequence[int],
        owner: str,
        locked_node: object | None,
    ) -> InsertResult:
        ps = self.page_size
        if len(tokens) != len(page_ids) * ps:
            raise ValueError(f"{len(tokens)} tokens are not {len(page_ids)} full pages")
        locked = None if locked_node is None else self._node(locked_node)
        prefix = [] if locked is None else self._locked_prefix(locked, namespace, tokens, page_ids)
        new_pages = page_ids[len(prefix) :]
        self._check_private(new_pages, owner, namespace)
        if locked is not None and locked.namespace != namespace:
            # A tenant's continuation of a public prefix: the tenant's subtree would need its own
            # copy of the public pages, so nothing is cached; the pages stay the request's.
            return InsertResult(list(page_ids), len(prefix) * ps, locked)
        inserted = self.tree.insert(namespace, tokens, page_ids)
        num_cached = inserted.num_cached_tokens // ps
        self.pool.transfer(page_ids[num_cached:], namespace)
        tree_pages = inserted.page_ids[:num_cached]
        self.pool.free(
            [p for p, t in zip(page_ids[:num_cached], tree_pages, strict=True) if p != t]
        )
        if inserted.node is not None:
            self.tree.lock(inserted.node)
        if locked is not None:
            self.tree.unlock(locked)
        self._enforce_share(namespace)
        return InsertResult(inserted.page_ids, inserted.num_cached_tokens, inserted.node)

    def _locked_prefix(
        self, locked: RadixNode, namespace: str, tokens: Sequence[int], page_ids: Sequence[int]
    ) -> list[int]:
        """The locked node's pages, checked to be the head of ``page_ids`` for the same tokens."""
        if not locked.attached:
            raise StaleNodeError("locked_node was evicted")
        if locked.namespace not in (namespace, PUBLIC_NAMESPACE):
            raise IsolationError(f"a node of {locked.namespace!r} cannot prefix {namespace!r}")
        if locked.direct_locks <= 0:
            raise CacheError("locked_node holds no lock")
        prefix = locked.path_page_ids()
        num_tokens = len(prefix) * self.page_size
        if list(page_ids[: len(prefix)]) != prefix or locked.path_tokens() != list(
            tokens[:num_tokens]
        ):
            raise PageOwnershipError("page_ids/tokens do not start with the locked prefix")
        return prefix

    def _check_private(self, page_ids: Sequence[int], owner: str, namespace: str) -> None:
        if len(set(page_ids)) != len(page_ids):
            raise PageOwnershipError("a page appears twice in page_ids")
        for page in page_ids:
            tag = self.pool.owner(page)
            if tag == owner:
                continue
            if tag not in (FREE, namespace, PUBLIC_NAMESPACE):
                raise IsolationError(f"page {page} belongs to {tag!r}, not to {owner!r}")
            raise PageOwnershipError(f"page {page} is {tag or 'free'!r}, not private to {owner!r}")

    # ----- public prefixes -----
    def pin(self, node: object) -> None:
        """Keep a public node and its ancestors resident until ``unpin`` (counted)."""
        handle = self._node(node)
        if handle.namespace != PUBLIC_NAMESPACE:
            raise IsolationError("only public prefixes can be pinned")
        self.tree.lock(handle)
        self._pins[handle] = self._pins.get(handle, 0) + 1

    def unpin(self, node: object) -> None:
        handle = self._node(node)
        count = self._pins.get(handle, 0)
        if not count:
            raise CacheError("node is not pinned")
        self.tree.unlock(handle)
        if count == 1:
            del self._pins[handle]
        else:
            self._pins[handle] = count - 1

    def publish(
        self,
        tokens: Sequence[int],
        page_ids: Sequence[int],
        owner: str,
        locked_node: object | None = None,
    ) -> int:
        """Cache a computed prefix in ``public`` and pin it; returns the pinned token count.

        The engine matches ``public``, locks, allocates and computes the rest as for a request,
        then calls this instead of ``cache``: ``locked_node`` is released, duplicates are freed
        and nothing stays with ``owner``. Publishing the same prefix again pins it only once.
        """
        result = self.cache(PUBLIC_NAMESPACE, tokens, page_ids, owner, locked_node)
        if result.node is None:
            return 0
        node = self._node(result.node)
        if node not in self._pins:
            self.pin(node)
        self.tree.unlock(node)
        return len(result.page_ids) * self.page_size

    def unpublish(self, tokens: Sequence[int]) -> int:
        """Release the pin of the public prefix made of ``tokens``' full pages.

        Returns the tokens released (0 when no prefix is pinned exactly there). Another published
        prefix that extends or shares these pages keeps its own pin. Unlocked public pages are
        freed at once, so tenants stop matching what is no longer published; pages a running
        request still holds go when it releases them, with the next unpublish or by eviction.
        """
        num_tokens = len(tokens) // self.page_size * self.page_size
        if not num_tokens:
            return 0
        found = self.tree.match_prefix(PUBLIC_NAMESPACE, tokens[:num_tokens])
        node = found.node
        if found.num_tokens != num_tokens or not isinstance(node, RadixNode):
            return 0
        count = self._pins.pop(node, 0)
        if not count:
            return 0
        for _ in range(count):
            self.tree.unlock(node)
        resident = self.tree.stats(PUBLIC_NAMESPACE).resident_pages
        self._release(self.tree.evict(resident, namespace=PUBLIC_NAMESPACE))
        return num_tokens

    # ----- namespaces and reports -----
    def drop_namespace(self, namespace: str) -> int:
        """Free every unlocked cached page of ``namespace`` (a deleted tenant); returns how many."""
        return self._release(self.tree.drop_namespace(namespace))

    def stats(self) -> dict[str, NamespaceSnapshot]:
        """Per-namespace residency, locks, share and hit counters."""
        names = list(self.tree.all_stats())
        names += [ns for ns in self.shares.capped_namespaces() if ns not in names]
        out: dict[str, NamespaceSnapshot] = {}
        for ns in names:
            s, share = self.tree.stats(ns), self.shares.get(ns)
            out[ns] = NamespaceSnapshot(
                ns,
                s.resident_pages,
                s.locked_pages,
                share.share,
                share.weight,
                self.shares.cap(ns),
                s.queries,
                s.queried_tokens,
                s.hit_tokens,
                s.public_hit_tokens,
                s.evicted_pages,
            )
        return out

    def _node(self, handle: object) -> RadixNode:
        if not isinstance(handle, RadixNode):
            raise CacheError(f"{type(handle).__name__} is not a node handle of this cache")
        return handle

    def check_integrity(self) -> None:
        """Pool, tree and their agreement: tree pages owned by their namespace, no leaks."""
        super().check_integrity()
        self.tree.check_integrity()
        in_tree: set[int] = set()
        evictable = 0
        for node in self.tree.iter_nodes():
            for page in node.page_ids:
                if self.pool.owner(page) != node.namespace:
                    raise IntegrityError(f"tree page {page} of {node.namespace!r} owned otherwise")
                in_tree.add(page)
            evictable += 0 if node.lock_ref else len(node.page_ids)
        for page in range(self.pool.num_pages):
            if _is_namespace_tag(self.pool.owner(page)) and page not in in_tree:
                raise IntegrityError(f"page {page} owned by a namespace but not in the tree")
        if self.num_available_pages != self.pool.num_free_pages + evictable:
            raise IntegrityError("num_available_pages disagrees with a full count")
        for node, count in self._pins.items():
            if not node.attached or node.direct_locks < count:
                raise IntegrityError("a pinned node lost its pin lock")
