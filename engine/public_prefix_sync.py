"""Keeps an engine's public prefixes equal to the published list, wherever that list comes from.

The gateway (from SQL) and the engine role (from the gateway's internal endpoint) both hand the
whole list to ``PublicPrefixSync.apply``: prefixes new to the list are computed and pinned,
prefixes gone from it are released. Each prefix is known by the id the list gives it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import structlog

from engine.errors import EngineDeadError, EngineError

if TYPE_CHECKING:  # the gateway's CLI imports this module; torch stays unloaded until needed
    from engine.async_engine import EngineClient

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class PrefixEntry:
    """One published prefix as a list names it."""

    id: str
    text: str


@dataclass(frozen=True, slots=True)
class HeldPrefix:
    """What this engine holds for a published prefix."""

    num_tokens: int  # tokens of its text
    num_cached_tokens: int  # of those, pinned as shared full pages
    pinned: tuple[int, ...]  # the pinned tokens (what releasing it takes)
    error: str | None = None  # why the engine could not keep it (e.g. longer than its context)


class PublicPrefixSync:
    """Applies published lists to one engine, one list at a time (an asyncio lock orders them).

    Two ids whose texts pin the same pages share the engine's one pin: it is released only when
    neither is published any more.
    """

    def __init__(self, engine: EngineClient) -> None:
        self._engine = engine
        self._held: dict[str, HeldPrefix] = {}
        self._lock = asyncio.Lock()
        self.version: str | None = None  # of the last list applied in full

    def held(self, prefix_id: str) -> HeldPrefix | None:
        return self._held.get(prefix_id)

    @property
    def held_ids(self) -> list[str]:
        return list(self._held)

    async def apply(self, entries: Sequence[PrefixEntry], version: str | None = None) -> None:
        """Publish what is new in ``entries`` and release what is gone; ``version`` is recorded
        once all of it is done. Raises EngineDeadError when the engine cannot take requests
        (what was done stays done; the next ``apply`` finishes the rest)."""
        async with self._lock:
            wanted = {entry.id: entry.text for entry in entries}
            for prefix_id in [p for p in self._held if p not in wanted]:
                await self._release(prefix_id)
            for prefix_id, text in wanted.items():
                if prefix_id not in self._held:
                    self._held[prefix_id] = await self._publish(prefix_id, text)
            self.version = version

    async def _publish(self, prefix_id: str, text: str) -> HeldPrefix:
        engine = self._engine
        token_ids = await asyncio.to_thread(engine.tokenizer.encode, text)
        try:
            result = await engine.publish_prefix(token_ids)
        except EngineDeadError:
            raise
        except EngineError as exc:  # this prefix is refused (too long): the others go on
            log.warning("public_prefix_refused", prefix_id=prefix_id, error=str(exc))
            return HeldPrefix(len(token_ids), 0, (), error=str(exc))
        pinned = tuple(token_ids[: result.num_cached_tokens])
        log.info(
            "public_prefix_held",
            prefix_id=prefix_id,
            num_tokens=len(token_ids),
            num_cached_tokens=result.num_cached_tokens,
        )
        return HeldPrefix(len(token_ids), result.num_cached_tokens, pinned)

    async def _release(self, prefix_id: str) -> None:
        held = self._held[prefix_id]
        shared = any(
            other.pinned == held.pinned for key, other in self._held.items() if key != prefix_id
        )
        if held.pinned and not shared:
            released = await self._engine.unpublish_prefix(list(held.pinned))
            log.info("public_prefix_released", prefix_id=prefix_id, num_tokens=released)
        del self._held[prefix_id]
