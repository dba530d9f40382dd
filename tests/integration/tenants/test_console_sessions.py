"""Server-side console sessions on SQLite and PostgreSQL: only hashes stored, a fixed lifetime,
revoked at sign-out, ended by a new admin token, expired rows deleted."""

from __future__ import annotations

import asyncio
import hashlib
from datetime import timedelta

from sqlalchemy import select

from tenants import Database
from tenants.console_sessions import ConsoleSessions
from tenants.models import ConsoleSessionRow
from tenants.server_secrets import ensure_admin_token

TOKEN = "console-admin-token-0123456789"


async def _rows(db: Database) -> list[ConsoleSessionRow]:
    async with db.sessions() as session:
        return list(await session.scalars(select(ConsoleSessionRow)))


def test_only_the_hash_of_a_session_id_is_stored(db_url: str, clock) -> None:
    async def body() -> None:
        db = await Database.connect(db_url)
        try:
            await ensure_admin_token(db, TOKEN)
            sessions = ConsoleSessions(db, clock)
            assert await sessions.sign_in("wrong-token") is None
            assert await sessions.sign_in("") is None
            opened = await sessions.sign_in(TOKEN)
            assert opened is not None and len(opened.session_id) >= 43  # 256 random bits
            (row,) = await _rows(db)
            assert row.id_hash == hashlib.sha256(opened.session_id.encode()).hexdigest()
            stored = {row.id_hash, row.admin_binding}
            assert opened.session_id not in stored
            assert await sessions.check(opened.session_id) == opened
            # What the database holds is no session id: presenting it gets nothing.
            assert await sessions.check(row.id_hash) is None
            assert await sessions.check(row.admin_binding) is None
            assert await sessions.check(None) is None
            assert await sessions.check("x" * 10_000) is None
        finally:
            await db.close()

    asyncio.run(body())


def test_a_session_ends_at_its_fixed_lifetime_and_at_sign_out(db_url: str, clock) -> None:
    async def body() -> None:
        db = await Database.connect(db_url)
        try:
            await ensure_admin_token(db, TOKEN)
            sessions = ConsoleSessions(db, clock, ttl=timedelta(hours=8))
            first = await sessions.sign_in(TOKEN)
            second = await sessions.sign_in(TOKEN)
            assert first is not None and second is not None
            assert first.expires_at == clock() + timedelta(hours=8)
            clock.advance(8 * 3600 - 1)
            assert await sessions.check(first.session_id) is not None  # use does not extend it
            await sessions.sign_out(second.session_id)
            assert await sessions.check(second.session_id) is None
            clock.advance(1)
            assert await sessions.check(first.session_id) is None
            assert len(await _rows(db)) == 1  # expired, not yet deleted
            third = await sessions.sign_in(TOKEN)  # signing in deletes expired rows
            assert third is not None
            assert [r.id_hash for r in await _rows(db)] == [
                hashlib.sha256(third.session_id.encode()).hexdigest()
            ]
            clock.advance(8 * 3600)
            await sessions.sign_out(None)  # and so does signing out
            assert await _rows(db) == []
        finally:
            await db.close()

    asyncio.run(body())


def test_a_new_admin_token_ends_every_session(db_url: str, clock) -> None:
    async def body() -> None:
        db = await Database.connect(db_url)
        try:
            await ensure_admin_token(db, TOKEN)
            sessions = ConsoleSessions(db, clock)
            opened = await sessions.sign_in(TOKEN)
            assert opened is not None
            await ensure_admin_token(db, TOKEN)  # a restart with the same token keeps it
            assert await sessions.check(opened.session_id) is not None
            await ensure_admin_token(db, "a-rotated-admin-token-987654321")
            assert await sessions.check(opened.session_id) is None
            assert await sessions.sign_in(TOKEN) is None
            assert await _rows(db) == []  # deleted, not merely refused
            await ensure_admin_token(db, TOKEN)  # going back to the old token revives nothing
            assert await sessions.check(opened.session_id) is None
        finally:
            await db.close()

    asyncio.run(body())
