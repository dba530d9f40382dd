"""The interface the engine uses for KV pages: allocation, prefix matching and caching.

Ownership rules (checked by ``check_integrity`` of implementations):
- A request's block table is ``[tree pages (locked prefix)] + [private pages]``. Tree pages are
  owned by a namespace of the cache and must stay locked (through the node handle) while the
  request uses them; private pages are owned by the request's owner tag.
- ``cache()`` hands a request's full pages to the tree. Pages the tree already had for the same
  tokens are duplicates: the cache frees the request's copies and returns the tree's page ids, which
  the request puts in its block table instead (same tokens at the same positions: same KV).
- Nothing here is thread-safe: one engine thread calls it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import NamedTuple

from radix_cache.errors import IsolationError
from radix_cache.page_pool import PagePool
from radix_cache.stats import NamespaceSnapshot

PUBLIC_NAMESPACE = "public"


def tenant_namespace(tenant_id: str) -> str:
    """The cache namespace of a tenant: the only one its requests may match or insert into."""
    return f"tenant:{tenant_id}"


def adapter_namespace(tenant_id: str, adapter: str) -> str:
    """The cache namespace of a tenant's requests through a LoRA adapter: the adapter changes
    every layer's K/V, so its pages never serve the base model, another adapter or another
    tenant."""
    return f"{tenant_namespace(tenant_id)}/lora:{adapter}"


class MatchResult(NamedTuple):
    page_ids: list[int]  # pages holding the matched prefix, in order
    num_tokens: int  # matched tokens, always len(page_ids) * page_size
    node: object | None  # handle for lock/unlock; None when nothing matched
    namespace: str  # where the match came from: the request's own namespace or "public"


class InsertResult(NamedTuple):
    page_ids: list[int]  # the tree's pages for the inserted tokens (replace the block table's)
    num_cached_tokens: int  # tokens that were already in the tree before this insert
    node: object | None  # handle of the deepest node now covering the tokens (already locked)


class PrefixCache(ABC):
    """KV page resource manager seen by the engine."""

    shares_pages = True  # whether computed pages can be reused by later requests

    def __init__(self, pool: PagePool, page_size: int) -> None:
        self.pool = pool
        self.page_size = page_size

    @property
    @abstractmethod
    def num_available_pages(self) -> int:
        """Pages that ``allocate`` can provide now: free ones plus evictable cached ones."""

    @abstractmethod
    def match(
        self, namespace: str, tokens: Sequence[int], allow_public: bool = True
    ) -> MatchResult:
        """Longest cached full-page prefix of ``tokens`` in ``namespace`` (else ``public``).

        Never looks at another tenant's namespace. Does not lock; may split nodes and refresh
        access times.
        """

    @abstractmethod
    def lock(self, node: object | None) -> None:
        """Protect the node and its ancestors from eviction (counted; None is a no-op)."""

    @abstractmethod
    def unlock(self, node: object | None) -> None:
        """Undo one ``lock`` of the node (None is a no-op)."""

    @abstractmethod
    def allocate(self, num_pages: int, owner: str, namespace: str) -> list[int]:
        """Private pages for ``owner`` (a request), evicting unlocked cached pages if needed.

        ``namespace`` is the requester's: a tenant over its cache share loses its own pages first.
        Raises OutOfPagesError when even eviction cannot provide them.
        """

    def free(self, page_ids: Sequence[int]) -> None:
        """Return a request's private pages to the pool."""
        self.pool.free(page_ids)

    @abstractmethod
    def cache(
        self,
        namespace: str,
        tokens: Sequence[int],
        page_ids: Sequence[int],
        owner: str,
        locked_node: object | None,
    ) -> InsertResult:
        """Insert ``tokens`` (a multiple of page_size) whose KV lives in ``page_ids``.

        The first pages may already be tree pages (the locked prefix); the others are private to
        ``owner``. Returns the tree's pages for all of ``tokens``; the new node is locked and
        ``locked_node`` unlocked. Duplicates of ``owner`` are freed.
        """

    def check_owner(self, page_ids: Sequence[int], namespace: str, owner: str) -> None:
        """Raise IsolationError if any page belongs to someone other than the request.

        Allowed owners: the request itself, its namespace, the public namespace.
        """
        pool_owner = self.pool.owner
        for page in page_ids:
            tag = pool_owner(page)
            if tag not in (owner, namespace, PUBLIC_NAMESPACE):
                raise IsolationError(
                    f"page {page} belongs to {tag or 'nobody'!r}, not to request {owner!r}"
                    f" of {namespace!r}"
                )

    def set_share(self, namespace: str, share: float | None, weight: float = 1.0) -> None:
        """Cap the pages ``namespace`` may keep cached (a fraction; None is unlimited)."""
        return None

    def publish(
        self,
        tokens: Sequence[int],
        page_ids: Sequence[int],
        owner: str,
        locked_node: object | None = None,
    ) -> int:
        """Keep a computed prefix in the public namespace; returns the tokens kept (0: none).

        ``locked_node`` is released. Without a tree nothing is kept and the pages stay the
        owner's, to be freed as usual.
        """
        self.unlock(locked_node)
        return 0

    def unpublish(self, tokens: Sequence[int]) -> int:
        """Stop sharing the public prefix made of ``tokens``' full pages; returns the tokens whose
        pin was released (0: no prefix was published there). Without a tree nothing is held."""
        return 0

    def drop_namespace(self, namespace: str) -> int:
        """Free every unlocked cached page of ``namespace`` (a tenant suspended or deleted);
        returns how many. Without a tree nothing is cached."""
        return 0

    def stats(self) -> dict[str, NamespaceSnapshot]:
        """Per-namespace residency and hit counters (empty without a tree)."""
        return {}

    def check_integrity(self) -> None:
        self.pool.check_integrity()


class NoPrefixCache(PrefixCache):
    """Prefix caching off: every page stays private to its request and is freed at its end."""

    shares_pages = False

    @property
    def num_available_pages(self) -> int:
        return self.pool.num_free_pages

    def match(
        self, namespace: str, tokens: Sequence[int], allow_public: bool = True
    ) -> MatchResult:
        return MatchResult([], 0, None, namespace)

    def lock(self, node: object | None) -> None:
        return None

    def unlock(self, node: object | None) -> None:
        return None

    def allocate(self, num_pages: int, owner: str, namespace: str) -> list[int]:
        return self.pool.allocate(num_pages, owner)

    def cache(
        self,
        namespace: str,
        tokens: Sequence[int],
        page_ids: Sequence[int],
        owner: str,
        locked_node: object | None,
    ) -> InsertResult:
        # Nothing enters a tree: the pages stay the request's, to be freed when it ends.
        if locked_node is not None:
            raise IsolationError("NoPrefixCache never hands out nodes")
        return InsertResult(list(page_ids), 0, None)


__all__ = [
    "PUBLIC_NAMESPACE",
    "InsertResult",
    "IsolationError",
    "MatchResult",
    "NoPrefixCache",
    "PrefixCache",
    "adapter_namespace",
    "tenant_namespace",
]
