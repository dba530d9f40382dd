"""Two gateways on one database hold a key-guessing address to one limit between them (20 a
minute, plus at most one guess per other gateway), not to 20 each."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from litestar.testing import TestClient

from tests.integration.gateway_fakes import MODEL, make_runtime, settings
from tests.integration.pg_gateway import migrated_database
from tests.support.postgres import migrate, pg_url
from web.app import create_app

BODY = {"model": MODEL, "prompt": "hi", "max_tokens": 2}


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        url = f"sqlite+aiosqlite:///{tmp_path / 'atrium.db'}"
        asyncio.run(migrate(url))
        yield url
        return
    with migrated_database() as name:
        yield pg_url(name)


def gateway(url: str, spool: Path, tiny_llama_dir: Path) -> TestClient[Any]:
    runtime, _ = make_runtime(tiny_llama_dir)
    config = settings(database_url=url, usage_spool_path=str(spool))
    return TestClient(create_app(config, engine=runtime, include_admin=False))


def guess(client: TestClient[Any], n: int) -> int:
    headers = {"Authorization": f"Bearer sk-atrium-guess{n:04d}-{'x' * 40}"}
    return client.post("/v1/completions", json=BODY, headers=headers).status_code


def test_failures_on_two_gateways_add_up(
    database_url: str, tmp_path: Path, tiny_llama_dir: Path
) -> None:
    with (
        gateway(database_url, tmp_path / "a.spool", tiny_llama_dir) as a,
        gateway(database_url, tmp_path / "b.spool", tiny_llama_dir) as b,
    ):
        assert [guess(a, n) for n in range(10)] == [401] * 10
        assert [guess(b, n) for n in range(10, 20)] == [401] * 10
        # B saw the twentieth failure; A learns of the count with its next one.
        assert guess(b, 20) == 429
        assert [guess(a, 21), guess(a, 22)] == [401, 429]
