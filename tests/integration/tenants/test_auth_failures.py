"""Failed authentications counted in the database: two gateways' failures from one address add
up to one limit, age out after the window, and other addresses are not held up."""

from __future__ import annotations

import asyncio

import pytest
from sqlalchemy import func, select

from tenants import Database
from tenants.auth_failures import AuthFailureStore
from tenants.models import AuthFailure

WINDOW_S = 60.0


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def test_two_gateways_share_one_limit(db_url: str) -> None:
    async def body() -> None:
        clock = Clock()
        db_a, db_b = await Database.connect(db_url), await Database.connect(db_url)
        try:
            a, b = AuthFailureStore(db_a, clock), AuthFailureStore(db_b, clock)
            assert await a.record("198.51.100.7", 4, WINDOW_S) is None
            clock.now += 10
            assert await b.record("198.51.100.7", 4, WINDOW_S) is None
            assert await a.record("198.51.100.7", 4, WINDOW_S) is None
            assert await b.record("192.0.2.1", 4, WINDOW_S) is None  # another address
            # The fourth failure of the address, on either gateway: held until the first ages.
            assert await b.record("198.51.100.7", 4, WINDOW_S) == pytest.approx(50.0)
            clock.now += 51  # the first failure has aged out; three remain
            assert await a.record("198.51.100.7", 4, WINDOW_S) == pytest.approx(9.0)
            clock.now += 10
            assert await a.record("198.51.100.7", 4, WINDOW_S) is None
            assert await a.record("x" * 300, 4, WINDOW_S) is None  # cut to the column
            assert await a.record("198.51.100.7", 0, WINDOW_S) is None  # 0: no limit
            async with db_a.sessions() as session:
                rows = await session.scalar(select(func.count()).select_from(AuthFailure))
            assert rows == 4  # what is older than the window was pruned
        finally:
            await db_a.close()
            await db_b.close()

    asyncio.run(body())
