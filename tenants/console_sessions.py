"""Console sessions kept server-side: sign in with the admin token, check, sign out.

The cookie holds a random 256-bit session id; the table holds only its SHA-256, so nothing read
from the database can be presented as a session. A session lives at most ``ttl`` from sign-in,
ends at sign-out, and ends for everyone when the admin token changes (each row carries a
fingerprint of the admin token hash it was opened under; setting a new token deletes the rest).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from datetime import datetime, timedelta
from typing import NamedTuple

from sqlalchemy import delete, select
from sqlalchemy.ext.asyncio import AsyncSession

from tenants.database import Database
from tenants.models import ConsoleSessionRow, Setting
from tenants.server_secrets import ADMIN_TOKEN_HASH, session_binding
from tenants.timeutil import Clock, utc_now

SESSION_TTL = timedelta(hours=8)
SESSION_ID_BYTES = 32  # 256 bits of randomness in the cookie
MAX_SESSION_ID_CHARS = 128  # anything longer is not one of ours; no need to hash it


class ConsoleSession(NamedTuple):
    """A live console session: its id (from the cookie) and when it ends at the latest."""

    session_id: str
    expires_at: datetime


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


async def _admin_token_hash(session: AsyncSession) -> str | None:
    return await session.scalar(select(Setting.value).where(Setting.key == ADMIN_TOKEN_HASH))


class ConsoleSessions:
    """Open, check and close console sessions on ``db``."""

    def __init__(self, db: Database, clock: Clock = utc_now, ttl: timedelta = SESSION_TTL) -> None:
        self._db = db
        self._clock = clock
        self.ttl = ttl

    async def sign_in(self, admin_token: str) -> ConsoleSession | None:
        """A new session when ``admin_token`` is the current one, else None.

        Sessions past their end are deleted on the way.
        """
        now = self._clock()
        async with self._db.transaction() as session:
            await session.execute(
                delete(ConsoleSessionRow).where(ConsoleSessionRow.expires_at <= now)
            )
            stored = await _admin_token_hash(session)
            if stored is None or not hmac.compare_digest(_digest(admin_token), stored):
                return None
            session_id = secrets.token_urlsafe(SESSION_ID_BYTES)
            row = ConsoleSessionRow(
                id_hash=_digest(session_id),
                admin_binding=session_binding(stored),
                created_at=now,
                expires_at=now + self.ttl,
            )
            session.add(row)
        return ConsoleSession(session_id, row.expires_at)

    async def check(self, session_id: str | None) -> ConsoleSession | None:
        """The live session ``session_id`` names, or None (unknown, ended, or opened under an
        admin token that has since changed)."""
        if not session_id or len(session_id) > MAX_SESSION_ID_CHARS:
            return None
        async with self._db.sessions() as session:
            row = await session.get(ConsoleSessionRow, _digest(session_id))
            stored = await _admin_token_hash(session)
        if row is None or stored is None or row.expires_at <= self._clock():
            return None
        if not hmac.compare_digest(row.admin_binding, session_binding(stored)):
            return None
        return ConsoleSession(session_id, row.expires_at)

    async def sign_out(self, session_id: str | None) -> None:
        """End ``session_id`` (if it names one) and delete every session past its end."""
        now = self._clock()
        async with self._db.transaction() as session:
            if session_id and len(session_id) <= MAX_SESSION_ID_CHARS:
                await session.execute(
                    delete(ConsoleSessionRow).where(
                        ConsoleSessionRow.id_hash == _digest(session_id)
                    )
                )
            await session.execute(
                delete(ConsoleSessionRow).where(ConsoleSessionRow.expires_at <= now)
            )
