"""KV pages as a resource: the page pool, the namespaced radix prefix cache and cache shares."""

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
    NoPrefixCache,
    PrefixCache,
    tenant_namespace,
)
from radix_cache.radix_prefix_cache import RadixPrefixCache
from radix_cache.radix_tree import RadixTree, TreeInsert
from radix_cache.shares import CacheShare, SharePolicy
from radix_cache.stats import NamespaceSnapshot, NamespaceStats

__all__ = [
    "FREE",
    "PUBLIC_NAMESPACE",
    "CacheError",
    "CacheShare",
    "InsertResult",
    "IntegrityError",
    "IsolationError",
    "MatchResult",
    "NamespaceSnapshot",
    "NamespaceStats",
    "NoPrefixCache",
    "OutOfPagesError",
    "PageOwnershipError",
    "PagePool",
    "PrefixCache",
    "RadixPrefixCache",
    "RadixTree",
    "SharePolicy",
    "StaleNodeError",
    "TreeInsert",
    "tenant_namespace",
]
