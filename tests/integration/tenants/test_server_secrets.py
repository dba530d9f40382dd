"""Server secrets when several gateway processes start together on one database."""

from __future__ import annotations

import asyncio

from tenants import Database
from tenants.server_secrets import ensure_admin_token, load_key_secret, verify_admin_token


async def _connect(url: str, n: int) -> list[Database]:
    return [await Database.connect(url) for _ in range(n)]


def test_gateways_setting_the_same_admin_token_at_once_all_start(db_url: str) -> None:
    """Each process stores the token's hash at startup; done at the same moment through
    separate connections, none may fail on a duplicate key, and the token then verifies."""

    async def run() -> None:
        dbs = await _connect(db_url, 4)
        try:
            for _ in range(3):  # a few rounds: the race needs the statements to overlap
                results = await asyncio.gather(
                    *(ensure_admin_token(db, "atr-admin-shared") for db in dbs),
                    return_exceptions=True,
                )
                assert results == [None] * len(dbs), results
            assert await verify_admin_token(dbs[0], "atr-admin-shared")
            assert not await verify_admin_token(dbs[0], "atr-admin-other")
            # A later start with another token replaces it.
            assert await ensure_admin_token(dbs[1], "atr-admin-rotated") is None
            assert await verify_admin_token(dbs[0], "atr-admin-rotated")
            assert not await verify_admin_token(dbs[0], "atr-admin-shared")
        finally:
            for db in dbs:
                await db.close()

    asyncio.run(run())


def test_generated_secrets_are_agreed_on_by_concurrent_starts(db_url: str) -> None:
    """Without configured values, exactly one start generates the admin token (and shows it)
    and every start reads the same key secret."""

    async def run() -> None:
        dbs = await _connect(db_url, 4)
        try:
            tokens = await asyncio.gather(*(ensure_admin_token(db, None) for db in dbs))
            shown = [t for t in tokens if t is not None]
            assert len(shown) == 1
            assert await verify_admin_token(dbs[2], shown[0])
            secrets = await asyncio.gather(*(load_key_secret(db) for db in dbs))
            assert len(set(secrets)) == 1 and len(secrets[0]) == 32
        finally:
            for db in dbs:
                await db.close()

    asyncio.run(run())
