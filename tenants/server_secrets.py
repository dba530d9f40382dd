"""Server secrets kept in the ``settings`` table: the key-HMAC secret and the admin token hash.

Both are created once with insert-if-absent, so concurrent gateway processes agree on them.
Setting a new admin token ends every console session opened under another one.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

from sqlalchemy import delete, select

from tenants.database import Database
from tenants.models import ConsoleSessionRow, Setting
from tenants.upsert import insert_ignore_stmt, insert_or_replace

KEY_SECRET = "key_hmac_secret"
ADMIN_TOKEN_HASH = "admin_token_sha256"
MIN_SECRET_BYTES = 16


def _sha256(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


def session_binding(admin_token_hash: str) -> str:
    """What a console session records of the admin token it was opened under."""
    return _sha256(f"atrium console session:{admin_token_hash}")


async def _get_or_create(db: Database, key: str, candidate: str) -> str:
    async with db.transaction() as session:
        await session.execute(
            insert_ignore_stmt(db.dialect, Setting), {"key": key, "value": candidate}
        )
        value = await session.scalar(select(Setting.value).where(Setting.key == key))
    return value if value is not None else candidate


async def load_key_secret(db: Database, override: bytes | None = None) -> bytes:
    """The HMAC secret for API keys: ``override`` (from the environment) or the stored one."""
    if override is not None:
        if len(override) < MIN_SECRET_BYTES:
            raise ValueError(f"the key secret needs at least {MIN_SECRET_BYTES} bytes")
        return override
    return bytes.fromhex(await _get_or_create(db, KEY_SECRET, secrets.token_hex(32)))


async def ensure_admin_token(db: Database, given: str | None) -> str | None:
    """Store the hash of ``given``; without one, generate a token if none is stored yet.

    Returns the plaintext only when it was generated here (to be shown once), else None.
    """
    if given is not None:
        # One statement, so gateways starting together on one database each set it (the same
        # value) instead of racing a delete and an insert into a duplicate key.
        row = {"key": ADMIN_TOKEN_HASH, "value": _sha256(given)}
        binding = session_binding(row["value"])
        async with db.transaction() as session:
            await session.execute(insert_or_replace(db, Setting, [row], ["key"]))
            await session.execute(
                delete(ConsoleSessionRow).where(ConsoleSessionRow.admin_binding != binding)
            )
        return None
    token = "atr-admin-" + secrets.token_urlsafe(32)
    stored = await _get_or_create(db, ADMIN_TOKEN_HASH, _sha256(token))
    return token if stored == _sha256(token) else None


async def verify_admin_token(db: Database, token: str) -> bool:
    async with db.sessions() as session:
        stored = await session.scalar(select(Setting.value).where(Setting.key == ADMIN_TOKEN_HASH))
    return stored is not None and hmac.compare_digest(_sha256(token), stored)
