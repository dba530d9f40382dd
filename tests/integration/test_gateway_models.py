"""Several models in one deployment: each request goes to the engine its ``model`` names, a
tenant sees and calls only the models its quotas allow, and usage and billing are per model
(on SQLite and PostgreSQL)."""

from __future__ import annotations

import asyncio
import csv
import io
import json
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from litestar import Litestar
from litestar.testing import TestClient

from tenants import Database
from tenants.server_secrets import ensure_admin_token
from tests.integration.gateway_fakes import settings
from tests.integration.test_admin_app import ADMIN_TOKEN, assert_error
from tests.support.postgres import migrate, pg_admin, pg_url, require_postgres
from tests.support.tiny_llama import make_tiny_llama
from web.app import create_app

Client = TestClient[Litestar]
PRICES = {"small": (2_000_000, 3_000_000), "big": (5_000_000, 7_000_000)}  # micros per token ×1e6


@pytest.fixture(scope="module")
def second_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny_llama_b"), seed=1)


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        url = f"sqlite+aiosqlite:///{tmp_path / 'models.db'}"
    else:
        require_postgres()
        name = f"atrium_models_{uuid.uuid4().hex[:10]}"
        asyncio.run(pg_admin(f"CREATE DATABASE {name}"))
        url = pg_url(name)

    async def prepare() -> None:
        await migrate(url)
        db = await Database.connect(url)
        try:
            await ensure_admin_token(db, ADMIN_TOKEN)
        finally:
            await db.close()

    try:
        asyncio.run(prepare())
        yield url
    finally:
        if request.param == "postgres":
            asyncio.run(pg_admin(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))


@pytest.fixture
def gateway(
    tiny_llama_dir: Path, second_model_dir: Path, database_url: str, tmp_path: Path
) -> Iterator[Client]:
    config = settings(
        model=f"small={tiny_llama_dir},big={second_model_dir}",
        dtype="float32",
        device="cpu",
        kv_cache_bytes=4 * 2**20,
        database_url=database_url,
        admin_token=ADMIN_TOKEN,
        engine_process=False,
        target_tpot_ms="off",
        usage_spool_path=str(tmp_path / "usage.spool"),
        max_loras=0,
    )
    with TestClient(create_app(config)) as client:
        yield client


def _admin(client: Client, method: str, path: str, **kwargs: Any) -> Any:
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    return client.request(method, path, headers=headers, **kwargs)


def _tenant_key(client: Client, name: str, **key: Any) -> tuple[str, dict[str, str]]:
    tenant = _admin(client, "POST", "/admin/v1/tenants", json={"name": name}).json()
    made = _admin(client, "POST", f"/admin/v1/tenants/{tenant['id']}/keys", json=key).json()
    return tenant["id"], {"Authorization": f"Bearer {made['key']}"}


def _complete(client: Client, auth: dict[str, str], model: str) -> Any:
    body = {"model": model, "prompt": "the lighthouse keeper", "max_tokens": 8,
            "temperature": 0}  # fmt: skip
    return client.post("/v1/completions", json=body, headers=auth)


def _listed(client: Client, auth: dict[str, str]) -> list[str]:
    return [m["id"] for m in client.get("/v1/models", headers=auth).json()["data"]]


def test_two_models_routed_allowed_and_billed_per_model(gateway: Client) -> None:
    for model, (price_in, price_out) in PRICES.items():
        price = {"input_per_million": price_in, "cached_input_per_million": price_in,
                 "output_per_million": price_out}  # fmt: skip
        assert _admin(gateway, "PUT", f"/admin/v1/prices/{model}", json=price).status_code == 200
    _, acme = _tenant_key(gateway, "acme")
    beta_id, beta = _tenant_key(gateway, "beta")
    _, beta_big_key = _tenant_key(gateway, "gamma", models=["big"])
    patched = _admin(
        gateway, "PATCH", f"/admin/v1/tenants/{beta_id}", json={"quotas": {"models": ["small"]}}
    )
    assert patched.status_code == 200, patched.text
    assert patched.json()["quotas"]["models"] == ["small"]

    assert _listed(gateway, acme) == ["small", "big"]
    assert _listed(gateway, beta) == ["small"]
    assert _listed(gateway, beta_big_key) == ["big"]

    small = _complete(gateway, acme, "small")
    big = _complete(gateway, acme, "big")
    assert small.status_code == big.status_code == 200, (small.text, big.text)
    assert (small.json()["model"], big.json()["model"]) == ("small", "big")
    # Different weights behind each name: the same greedy prompt answers differently, and
    # each model answers the same way again.
    assert small.json()["choices"][0]["text"] != big.json()["choices"][0]["text"]
    streamed = gateway.post(
        "/v1/completions",
        json={
            "model": "big",
            "prompt": "the lighthouse keeper",
            "max_tokens": 8,
            "temperature": 0,
            "stream": True,
        },
        headers=beta_big_key,
    )
    frames = [f.removeprefix("data: ") for f in streamed.text.split("\n\n") if f]
    chunks = [json.loads(f) for f in frames[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == big.json()["choices"][0]["text"]
    # An adapter may not take a served model's name, the second one's included.
    adapter = {"name": "big", "path": "/nowhere"}
    assert_error(_admin(gateway, "POST", "/admin/v1/lora-adapters", json=adapter), 409)
    again = _complete(gateway, beta, "small")
    assert again.status_code == 200, again.text
    assert again.json()["choices"][0]["text"] == small.json()["choices"][0]["text"]

    # A model outside the tenant's list is as absent as one that does not exist.
    hidden = assert_error(_complete(gateway, beta, "big"), 404, "model_not_found")
    unknown = assert_error(_complete(gateway, beta, "huge"), 404, "model_not_found")
    assert hidden["message"].replace("big", "X") == unknown["message"].replace("huge", "X")
    assert_error(gateway.get("/v1/models/big", headers=beta), 404, "model_not_found")
    assert gateway.get("/v1/models/small", headers=beta).status_code == 200
    chat = {"model": "big", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert_error(gateway.post("/v1/chat/completions", json=chat, headers=beta), 404)
    refused = _admin(
        gateway, "PATCH", f"/admin/v1/tenants/{beta_id}", json={"quotas": {"models": []}}
    )
    assert_error(refused, 400)

    # /metrics counts both engines' KV pages.
    pages = [engine.stats().num_pages_total for engine in gateway.app.state.engine.engines]
    assert len(pages) == 2 and min(pages) > 0
    shown = [line for line in gateway.get("/metrics").text.splitlines()
             if line.startswith("atrium_kv_pages_total ")]  # fmt: skip
    assert shown and float(shown[0].split()[1]) == sum(pages)
    engine_page = _admin(gateway, "GET", "/admin/v1/engine")
    assert engine_page.status_code == 200, engine_page.text
    assert engine_page.json()["kv_pages_total"] == sum(pages)

    now = datetime.now(UTC)
    window = {"start": (now - timedelta(days=1)).isoformat(),
              "end": (now + timedelta(days=1)).isoformat()}  # fmt: skip
    rows: list[dict[str, str]] = []
    for _ in range(100):  # the meter writes usage rows shortly after each answer
        export = _admin(gateway, "GET", "/admin/v1/billing/export", params=window)
        rows = list(csv.DictReader(io.StringIO(export.text)))
        if sum(int(r["requests"]) for r in rows) == 4:
            break
        time.sleep(0.1)
    by = {(r["tenant_name"], r["model"]): r for r in rows}
    assert sorted(by) == [
        ("acme", "big"), ("acme", "small"), ("beta", "small"), ("gamma", "big")
    ], export.text  # fmt: skip
    for (_, model), row in by.items():
        price_in, price_out = PRICES[model]
        expected = (
            int(row["prompt_tokens"]) * price_in + int(row["completion_tokens"]) * price_out
        ) // 1_000_000
        assert int(row["requests"]) == 1
        assert int(row["completion_tokens"]) > 0
        assert int(row["cost_micros"]) == expected


def test_settings_name_each_model() -> None:
    config = settings(model="a=/m/one, b=/m/two")
    assert config.model_specs == [("a", "/m/one"), ("b", "/m/two")]
    assert settings(model="/m/one", served_model_name="x").model_specs == [("x", "/m/one")]
    one = settings(model="a=/m/one").single_model()
    assert (one.model, one.served_model_name) == ("/m/one", "a")
    plain = settings(model="/m/one")
    assert plain.single_model() is plain
    with pytest.raises(ValueError):
        config.single_model()
    for bad in ({"model": "a=/m/one,a=/m/two"}, {"model": "a=,b=/m"},
                {"model": "a=/m,b=/n", "served_model_name": "x"}):  # fmt: skip
        with pytest.raises(ValueError):
            settings(**bad)


def test_repeated_model_flags_make_one_setting() -> None:
    from web.cli import build_parser
    from web.settings import Settings

    args = build_parser().parse_args(["serve", "--model", "a=/m/one", "--model", "b=/m/two"])
    flags = {name: getattr(args, name, None) for name in Settings.__struct_fields__}
    loaded = Settings.load(flags, environ={})
    assert loaded.model_specs == [("a", "/m/one"), ("b", "/m/two")]


def test_gateway_role_sends_each_model_to_its_own_engine_url(
    tiny_llama_dir: Path, second_model_dir: Path
) -> None:
    import httpx

    from tests.integration.gateway_fakes import KEY_A, make_tenancy
    from tests.integration.test_gateway_remote_engine import CutStream, frame
    from web.engine_api.client import HttpEngineClient
    from web.engine_api.gateway import remote_runtimes
    from web.settings import Settings

    config = settings(
        role="gateway",
        engine_token="secret",
        model=f"small={tiny_llama_dir},big={second_model_dir}",
        engine_url="big=http://big.test, small=http://small.test",
    )
    remotes = remote_runtimes(config)
    assert [(r.name, c.url) for r, c in remotes] == [
        ("small", "http://small.test"),
        ("big", "http://big.test"),
    ]
    for bad in ("http://one.test", "small=http://s.test", "small=http://s.test,x=http://x.test"):
        with pytest.raises(ValueError):
            settings(role="gateway", engine_token="t", model=config.model, engine_url=bad)
    plain = Settings.load({"role": "gateway", "engine_token": "t", "engine_url": "http://r:1"})
    assert [c.url for _, c in remote_runtimes(plain)] == ["http://r:1"]

    # The routed names reach their own engines: each answers with its own text.
    hits: list[str] = []

    def engine(name: str) -> httpx.MockTransport:
        def answer(request: httpx.Request) -> httpx.Response:
            hits.append(name)
            frames = [frame(name, 1), frame("", 1, "stop"), b"data: [DONE]\n\n"]
            return httpx.Response(200, stream=CutStream(frames, clean=True))

        return httpx.MockTransport(answer)

    runtimes = []
    for runtime, client in remotes:
        runtime.engine = HttpEngineClient(
            client.url, "secret", runtime.tokenizer, runtime.name, transport=engine(runtime.name)
        )
        runtimes.append(runtime)
    app = create_app(settings(), engine=runtimes, store=make_tenancy(), include_admin=False)
    auth = {"Authorization": f"Bearer {KEY_A}"}
    with TestClient(app) as client:
        for model in ("big", "small", "big"):
            body = {"model": model, "prompt": "hi", "max_tokens": 3}
            done = client.post("/v1/completions", json=body, headers=auth)
            assert done.status_code == 200, done.text
            assert done.json()["choices"][0]["text"] == model
    assert hits == ["big", "small", "big"]


def test_each_engine_takes_its_share_of_the_kv_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    import web.engine_api.local as local
    from web.openai.generation import ModelRuntime

    seen: list[tuple[str, str | None, float | None]] = []
    closed: list[str] = []

    async def fake_load(one: Any) -> tuple[ModelRuntime, Any, Any]:
        seen.append((one.model, one.served_model_name, one.kv_cache_memory_fraction))

        async def close() -> None:
            closed.append(one.model)

        runtime = ModelRuntime(one.served_model_name, None, None, max_model_len=8)  # type: ignore[arg-type]
        return runtime, object(), close

    monkeypatch.setattr(local, "load_runtime", fake_load)
    config = settings(model="a=/m/a,b=/m/b,c=/m/c", kv_cache_memory_fraction=0.6, device="cpu")
    runtimes, _, close = asyncio.run(local.load_runtimes(config))
    assert [r.name for r in runtimes] == ["a", "b", "c"]
    assert [(m, n) for m, n, _ in seen] == [("/m/a", "a"), ("/m/b", "b"), ("/m/c", "c")]
    assert [f for _, _, f in seen] == pytest.approx([0.2, 0.2, 0.2])
    asyncio.run(close())
    assert closed == ["/m/c", "/m/b", "/m/a"]
    seen.clear()
    asyncio.run(local.load_runtimes(settings(model="a=/m/a,b=/m/b", device="cpu")))
    assert [f for _, _, f in seen] == pytest.approx([0.125, 0.125])  # CPU's 0.25, halved
