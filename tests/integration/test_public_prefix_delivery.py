"""Public prefixes reach the engine: published ones survive a gateway restart, changes arrive at
once (admin API) or by polling (the CLI, another gateway), and engines of the engine role fetch
them from the gateway's internal endpoint, which answers only the engine token."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from litestar import Litestar
from litestar.testing import AsyncTestClient, TestClient

from tenants.database import Database
from tenants.public_prefixes import PublicPrefixService
from tests.integration.test_admin_app import ADMIN_TOKEN, assert_error, migrated_sqlite
from web.app import create_app
from web.settings import Settings

Client = TestClient[Litestar]
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
ENGINE_TOKEN = "engine-token-0123456789"
RULES = "Rules for every answer: be brief, be kind, cite sources, never guess. " * 3
FEED = "/internal/v1/public-prefixes"


def gateway_settings(tmp_path: Path, model_dir: Path) -> Settings:
    return Settings(
        database_url=migrated_sqlite(tmp_path / "gateway.db"),
        admin_token=ADMIN_TOKEN,
        engine_token=ENGINE_TOKEN,
        usage_spool_path=str(tmp_path / "usage.spool"),
        model=str(model_dir),
        dtype="float32",
        device="cpu",
        kv_cache_bytes=8 * 2**20,
        engine_process=False,
        target_tpot_ms="off",
    )


@pytest.fixture
def config(tmp_path: Path, tiny_llama_dir: Path) -> Settings:
    return gateway_settings(tmp_path, tiny_llama_dir)


def tenant_key(client: Client, name: str) -> dict[str, str]:
    tenant = client.post("/admin/v1/tenants", json={"name": name}, headers=ADMIN)
    assert tenant.status_code == 201, tenant.text
    key = client.post(f"/admin/v1/tenants/{tenant.json()['id']}/keys", json={}, headers=ADMIN)
    return {"Authorization": f"Bearer {key.json()['key']}"}


def cached_tokens(client: Client, auth: dict[str, str], suffix: str) -> int:
    model = client.get("/v1/models", headers=auth).json()["data"][0]["id"]
    body = {"model": model, "prompt": RULES + suffix, "max_tokens": 2, "temperature": 0}
    answer = client.post("/v1/completions", json=body, headers=auth)
    assert answer.status_code == 200, answer.text
    return int(answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def wait_until(predicate: Any, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "not reached in time"
        time.sleep(0.1)


def test_published_prefixes_survive_a_restart_and_unpublish_reaches_the_engine(
    config: Settings,
) -> None:
    with TestClient(create_app(config)) as client:
        published = client.post("/admin/v1/public-prefixes", json={"text": RULES}, headers=ADMIN)
        assert published.status_code == 201, published.text
        prefix = published.json()
        assert prefix["num_cached_tokens"] > 0 and prefix["engine_error"] is None
        too_long = client.post(
            "/admin/v1/public-prefixes", json={"text": "word " * 5000}, headers=ADMIN
        )
        assert_error(too_long, 400, "context_length_exceeded")
        acme = tenant_key(client, "acme")
        assert cached_tokens(client, acme, " Question one?") == prefix["num_cached_tokens"]

    # A new gateway on the same database publishes it again before it serves.
    with TestClient(create_app(config)) as client:
        listed = client.get("/admin/v1/public-prefixes", headers=ADMIN).json()
        assert [p["id"] for p in listed] == [prefix["id"]]
        assert listed[0]["num_cached_tokens"] == prefix["num_cached_tokens"]
        globex = tenant_key(client, "globex")
        assert cached_tokens(client, globex, " Question two?") == prefix["num_cached_tokens"]

        gone = client.delete(f"/admin/v1/public-prefixes/{prefix['id']}", headers=ADMIN)
        assert gone.status_code == 200, gone.text
        initech = tenant_key(client, "initech")
        assert cached_tokens(client, initech, " Question three?") == 0  # released at once

    with TestClient(create_app(config)) as client:
        assert client.get("/admin/v1/public-prefixes", headers=ADMIN).json() == []
        umbrella = tenant_key(client, "umbrella")
        assert cached_tokens(client, umbrella, " Question four?") == 0


def test_a_prefix_stored_elsewhere_arrives_by_polling(config: Settings) -> None:
    async def store_directly() -> str:  # as `atrium public-prefixes publish` does
        db = await Database.connect(config.database_url)
        try:
            return (await PublicPrefixService(db).publish(RULES, actor="cli")).id
        finally:
            await db.close()

    with TestClient(create_app(config)) as client:
        acme = tenant_key(client, "acme")
        prefix_id = asyncio.run(store_directly())

        def held() -> bool:
            view = client.get(f"/admin/v1/public-prefixes/{prefix_id}", headers=ADMIN).json()
            return bool(view["num_cached_tokens"])

        wait_until(held)
        assert cached_tokens(client, acme, " Polled?") > 0


@pytest.fixture
def feed_client(config: Settings) -> Iterator[Client]:
    with TestClient(create_app(config)) as client:
        yield client


REFUSED = [
    "Bearer wrong",
    f"Bearer {ENGINE_TOKEN}x",
    f"Basic {ENGINE_TOKEN}",
    ENGINE_TOKEN,
    "Bearer ünïcode",
    f"Bearer {ADMIN_TOKEN}",
]


def test_the_internal_feed_answers_only_the_engine_token(feed_client: Client) -> None:
    assert_error(feed_client.get(FEED), 401, "invalid_engine_token")
    for header in REFUSED:
        response = feed_client.get(FEED, headers={b"Authorization": header.encode("utf-8")})
        assert_error(response, 401, "invalid_engine_token")
    assert feed_client.get(FEED, headers={"Authorization": f"Bearer {ENGINE_TOKEN}"}).is_success
    # Guessing is throttled per address, as for the admin token.
    statuses = [feed_client.get(FEED, headers={"Authorization": "Bearer guess"}).status_code]
    while statuses[-1] == 401 and len(statuses) < 30:
        statuses.append(
            feed_client.get(FEED, headers={"Authorization": "Bearer guess"}).status_code
        )
    assert statuses[-1] == 429 and len(statuses) + len(REFUSED) + 1 <= 21


def test_the_feed_refuses_tenant_keys_and_versions_its_answer(feed_client: Client) -> None:
    key = tenant_key(feed_client, "acme")
    assert_error(feed_client.get(FEED, headers=key), 401, "invalid_engine_token")
    engine = {"Authorization": f"Bearer {ENGINE_TOKEN}"}
    empty = feed_client.get(FEED, headers=engine)
    assert empty.status_code == 200 and empty.json()["prefixes"] == []
    feed_client.post("/admin/v1/public-prefixes", json={"text": RULES}, headers=ADMIN)
    full = feed_client.get(FEED, headers=engine)
    assert [p["text"] for p in full.json()["prefixes"]] == [RULES]
    assert full.headers["etag"] == f'"{full.json()["version"]}"' != empty.headers["etag"]
    same = feed_client.get(FEED, headers={**engine, "If-None-Match": full.headers["etag"]})
    assert same.status_code == 304 and same.content == b""
    stale = feed_client.get(FEED, headers={**engine, "If-None-Match": empty.headers["etag"]})
    assert stale.status_code == 200


def test_without_an_engine_token_the_feed_is_closed(tmp_path: Path, tiny_llama_dir: Path) -> None:
    config = gateway_settings(tmp_path, tiny_llama_dir)
    open_config = Settings.load({**{f: getattr(config, f) for f in config.__struct_fields__},
                                 "engine_token": None}, environ={})  # fmt: skip
    with TestClient(create_app(open_config)) as client:
        for header in ("Bearer ", "Bearer None", f"Bearer {ENGINE_TOKEN}"):
            assert_error(client.get(FEED, headers={"Authorization": header}), 401)


def test_an_engine_follows_the_gateway_feed(config: Settings, tiny_llama_dir: Path) -> None:
    """An engine with no database (the engine role) keeps what the gateway publishes."""
    import torch

    from engine.async_engine import AsyncEngine
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.model.loader import load_model
    from engine.public_prefix_sync import PublicPrefixSync
    from radix_cache import RadixPrefixCache
    from web.tenancy.prefix_feed import follow_public_prefixes, start_following

    async def main() -> None:
        loaded = load_model(str(tiny_llama_dir), dtype=torch.float32)
        config_ = EngineConfig(num_pages=64, max_num_batched_tokens=256, max_num_seqs=4)
        engine = AsyncEngine(LLMEngine(loaded, config_, prefix_cache_factory=RadixPrefixCache))
        engine.start()
        sync = PublicPrefixSync(engine)
        async with AsyncTestClient(create_app(config)) as gateway:
            follower = asyncio.create_task(
                follow_public_prefixes(
                    engine, str(gateway.base_url), ENGINE_TOKEN, poll_s=0.1, sync=sync,
                    client=gateway,
                )
            )  # fmt: skip
            try:
                answer = await gateway.post(
                    "/admin/v1/public-prefixes", json={"text": RULES}, headers=ADMIN
                )
                prefix_id = answer.json()["id"]
                await wait_async(lambda: sync.held(prefix_id) is not None)
                held = sync.held(prefix_id)
                assert held is not None and held.num_cached_tokens > 0
                await wait_async(lambda: engine.stats().num_pages_available < 64)
                await gateway.delete(f"/admin/v1/public-prefixes/{prefix_id}", headers=ADMIN)
                await wait_async(lambda: sync.held_ids == [])
                await wait_async(lambda: engine.stats().num_pages_available == 64)
                assert not follower.done()  # 304s and applies keep it running
                assert start_following(engine, None, ENGINE_TOKEN) is None
                assert start_following(object(), "http://127.0.0.1:9", ENGINE_TOKEN) is None
                unreachable = start_following(engine, "http://127.0.0.1:9", ENGINE_TOKEN, 0.05)
                assert unreachable is not None
                await asyncio.sleep(0.3)
                assert not unreachable.done()  # a gateway away is retried, not fatal
                unreachable.cancel()
            finally:
                follower.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await follower
                await engine.shutdown()

    asyncio.run(main())


async def wait_async(predicate: Any, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "not reached in time"
        await asyncio.sleep(0.05)
