"""A running request's pages: how many new tokens fit, growing its block table, and handing
computed full pages to the prefix cache (on every chunk, on release, on publish)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.request import Request
from radix_cache.prefix_cache import PrefixCache


@dataclass(slots=True)
class RequestPages:
    cache: PrefixCache

    @property
    def page_size(self) -> int:
        return self.cache.page_size

    def num_fitting(self, request: Request, want: int, reserve: int = 0) -> int:
        """How many of ``want`` new tokens the request's pages plus the available pages, less
        ``reserve`` pages kept for others, can hold."""
        num_pages = len(request.block_table) + self.cache.num_available_pages - reserve
        room = num_pages * self.page_size - request.num_computed_tokens
        return max(0, min(want, room))

    def grow(self, request: Request, num_new: int) -> None:
        num_tokens = request.num_computed_tokens + num_new
        need = -(-num_tokens // self.page_size) - len(request.block_table)
        if need > 0:
            request.block_table.extend(self.cache.allocate(need, request.owner, request.namespace))

    def cache_computed(self, request: Request) -> None:
        """Hand the request's computed full pages not yet in the tree to the cache."""
        num_full = request.num_computed_tokens // self.page_size
        if num_full <= request.num_tree_pages:
            return
        result = self.cache.cache(
            request.namespace,
            request.all_token_ids[: num_full * self.page_size],
            request.block_table[:num_full],
            request.owner,
            request.cache_node,
        )
        request.block_table[:num_full] = result.page_ids
        request.cache_node = result.node
        request.num_tree_pages = num_full

    def release(self, request: Request) -> None:
        """Cache what it computed, unlock its prefix, free its private pages."""
        self.cache_computed(request)
        self.cache.unlock(request.cache_node)
        request.cache_node = None
        owner = self.cache.pool.owner
        self.cache.free([page for page in request.block_table if owner(page) == request.owner])
        request.block_table = []
        request.num_tree_pages = 0

    def publish(self, request: Request) -> None:
        """Hand a computed public prefix to the cache, pinned; its full pages leave the request."""
        num_full = request.num_computed_tokens // self.page_size
        request.num_published_tokens = self.cache.publish(
            request.all_token_ids[: num_full * self.page_size],
            request.block_table[:num_full],
            request.owner,
            request.cache_node,
        )
        request.cache_node = None
        request.num_tree_pages = num_full
