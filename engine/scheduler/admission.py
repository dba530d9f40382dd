"""Starting a waiting request: its cached prefix (own namespace, public when allowed), its LoRA
adapter's slot, and whether it should wait for a prefix a running prompt is computing now."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.request import Request
from radix_cache.prefix_cache import PrefixCache

if TYPE_CHECKING:
    from engine.lora.slots import AdapterSlots


def acquire_adapter(slots: AdapterSlots | None, request: Request) -> bool:
    """Pin a slot for the request's adapter (loading it there if needed); False when every
    slot is pinned by other adapters' running requests."""
    if request.lora is None or slots is None:
        return True
    slot = slots.acquire(request.lora)
    if slot is None:
        return False
    request.lora_slot = slot
    return True


def release_adapter(slots: AdapterSlots | None, request: Request) -> None:
    if request.lora_slot >= 0 and slots is not None:
        slots.release(request.lora_slot)
    request.lora_slot = -1


def lock_prefix(cache: PrefixCache, request: Request) -> int:
    """Match and lock the request's cached prefix; returns the tokens matched. At least the
    last token is always run: its logits choose the next token."""
    match = cache.match(request.namespace, request.all_token_ids[:-1], request.allow_public_prefix)
    cache.lock(match.node)
    request.cache_node = match.node
    request.block_table = list(match.page_ids)
    request.num_tree_pages = len(match.page_ids)
    request.num_computed_tokens = match.num_tokens
    return match.num_tokens


def unlock_prefix(cache: PrefixCache, request: Request) -> None:
    cache.unlock(request.cache_node)
    request.cache_node = None
    request.block_table = []
    request.num_tree_pages = 0
    request.num_computed_tokens = 0


def follows_inflight_prefill(
    cache: PrefixCache, running: list[Request], request: Request, num_matched: int
) -> bool:
    """Whether a running prefill of the same namespace is computing pages ``request`` could
    reuse beyond what it matched: then it waits rather than computing them a second time.
    Costs O(running prefills × shared pages): the current step's work only."""
    if not cache.shares_pages:
        return False
    page = cache.page_size
    tokens = request.all_token_ids
    reusable_limit = (len(tokens) - 1) // page * page
    for other in running:
        if other.namespace != request.namespace or other.num_remaining_tokens <= 1:
            continue
        if other.num_computed_tokens >= reusable_limit:
            continue
        shared = num_matched
        other_tokens = other.all_token_ids
        while (
            shared + page <= reusable_limit
            and tokens[shared : shared + page] == other_tokens[shared : shared + page]
        ):
            shared += page
        if shared > num_matched and other.num_computed_tokens < shared:
            return True
    return False
