"""Health probes answer while writers hold the database and every pooled connection is taken."""

from __future__ import annotations

import asyncio
import time

from sqlalchemy import text

from tenants import Database

PROBE_TIMEOUT_S = 0.5


async def _probe_seconds(db: Database) -> float:
    started = time.monotonic()
    assert await db.probe(PROBE_TIMEOUT_S)
    return time.monotonic() - started


def test_a_probe_does_not_wait_for_a_writer(db_url: str) -> None:
    async def body() -> None:
        db = await Database.connect(db_url)
        writer = await Database.connect(db_url)
        try:
            async with writer.transaction() as session:
                # A write in flight: on SQLite this transaction holds the write lock.
                await session.execute(
                    text("INSERT INTO settings (key, value) VALUES ('probe-test', 'x')")
                )
                assert await _probe_seconds(db) < PROBE_TIMEOUT_S
                # The pool's own connection waits for that lock on SQLite; the probe did not.
                if db.dialect == "sqlite":
                    assert not await db.ping(0.3)
        finally:
            await writer.close()
            await db.close()

    asyncio.run(body())


def test_a_probe_does_not_queue_behind_the_pool(db_url: str) -> None:
    async def body() -> None:
        db = await Database.connect(db_url, pool_size=1)
        try:
            # Take every pooled connection (SQLite keeps one; PostgreSQL one plus one overflow).
            held = [await db.engine.connect() for _ in range(1 if db.dialect == "sqlite" else 2)]
            try:
                assert await _probe_seconds(db) < PROBE_TIMEOUT_S
            finally:
                for conn in held:
                    await conn.close()
        finally:
            await db.close()

    asyncio.run(body())
