"""Public prefixes in SQL: publish, list, unpublish, their audit rows and the set's version."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest

from tenants.errors import ConflictError, InvalidInputError, NotFoundError
from tenants.public_prefixes import MAX_PREFIX_CHARS, PublicPrefixService
from tests.integration.tenants.conftest import FakeClock, OpenDomain


def test_publish_list_unpublish_with_history_and_audit(
    open_domain: OpenDomain, clock: FakeClock
) -> None:
    async def body() -> None:
        async with open_domain() as domain:
            service: PublicPrefixService = domain.public_prefixes
            start = clock()
            empty = await service.version()
            rules = await service.publish("You are a careful assistant.", actor="alice")
            assert rules.id.startswith("pp_") and rules.created_by == "alice"
            assert rules.created_at == start and rules.unpublished_at is None
            clock.advance(1)
            style = await service.publish("Answer in French.", actor="alice")
            with pytest.raises(ConflictError):
                await service.publish("You are a careful assistant.")
            assert [p.id for p in await service.list_prefixes()] == [rules.id, style.id]
            both = await service.published()
            assert both.version == await service.version() != empty
            assert [p.text for p in both.prefixes] == [rules.text, style.text]

            clock.advance(1)
            gone = await service.unpublish(rules.id, actor="bob")
            assert gone.unpublished_at == clock() and gone.unpublished_by == "bob"
            assert await service.get(rules.id) == gone
            with pytest.raises(ConflictError):
                await service.unpublish(rules.id)
            with pytest.raises(NotFoundError):
                await service.unpublish("pp_missing")
            with pytest.raises(NotFoundError):
                await service.get("x" * 500)
            assert [p.id for p in await service.list_prefixes()] == [style.id]
            history = await service.list_prefixes(include_unpublished=True)
            assert [p.id for p in history] == [rules.id, style.id]
            assert (await service.published()).version not in (both.version, empty)

            # The text is free again once unpublished; a new id, so a new version.
            again = await service.publish("You are a careful assistant.", actor="carol")
            assert again.id != rules.id

            entries = await domain.audit.entries(start, clock() + timedelta(seconds=1))
            assert [(e.action, e.actor, e.target) for e in entries] == [
                ("public_prefix.publish", "alice", rules.id),
                ("public_prefix.publish", "alice", style.id),
                ("public_prefix.unpublish", "bob", rules.id),
                ("public_prefix.publish", "carol", again.id),
            ]
            assert entries[2].before is not None and entries[2].before["unpublished_at"] is None
            assert entries[2].after is not None and entries[2].after["unpublished_by"] == "bob"

    asyncio.run(body())


BAD_TEXTS = ["", "   \n", "a\x00b", "\ud800 lone", "x" * (MAX_PREFIX_CHARS + 1)]


def test_bad_texts_are_refused_and_nothing_is_stored(open_domain: OpenDomain) -> None:
    async def body() -> None:
        async with open_domain() as domain:
            for text in BAD_TEXTS:
                with pytest.raises(InvalidInputError):
                    await domain.public_prefixes.publish(text)
            assert await domain.public_prefixes.list_prefixes(include_unpublished=True) == []

    asyncio.run(body())


def test_concurrent_publishes_of_one_text_store_one_row(open_domain: OpenDomain) -> None:
    async def body() -> None:
        async with open_domain() as domain:
            service = domain.public_prefixes
            results = await asyncio.gather(
                *(service.publish("shared rules") for _ in range(4)), return_exceptions=True
            )
            stored = [r for r in results if not isinstance(r, BaseException)]
            assert len(stored) == 1
            assert all(isinstance(r, ConflictError) for r in results if r not in stored)
            assert len(await service.list_prefixes()) == 1

    asyncio.run(body())
