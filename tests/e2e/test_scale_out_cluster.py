"""Atrium scaled out on loopback: two engine servers behind the smg router, two gateways on one
PostgreSQL, driven with the official `openai` client. Prefix reuse stays per tenant across the
router's placement, quotas hold across gateways, and an engine killed mid-stream is metered once
for what it delivered while the other engine serves what follows."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam
from sqlalchemy import select

from bench.cluster import (
    router_binary,
    start_engine,
    start_gateway,
    start_router,
    stop_all,
    wait_all,
    wait_workers,
)
from bench.servers import Server
from engine.tokenizer import Tokenizer
from tenants import Database
from tenants.models import UsageEventRow
from tenants.schemas import Quotas
from tests.integration.pg_gateway import ADMIN_TOKEN, create_tenant, migrated_database, read_books
from tests.support.postgres import pg_url
from tests.support.serve import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.postgres]

TOKEN = "cluster-engine-token-0123456789"
LONG = "Our shared policy text: answer briefly, cite sources, never guess. " * 6
MAX_TOKENS_BUDGET = 8


@dataclass
class Cluster:
    engines: list[Server]
    router: Server
    gateways: list[Server]
    db_url: str
    keys: dict[str, str]
    model: str
    tokenizer: Tokenizer
    restart: Callable[[int], Server]  # an engine again on the given port

    def client(self, tenant: str, gateway: int = 0) -> openai.OpenAI:
        base = f"{self.gateways[gateway].base_url}/v1"
        return openai.OpenAI(base_url=base, api_key=self.keys[tenant], max_retries=0)


def _tenants(url: str, spool: Path, per_request: int) -> dict[str, str]:
    budget = 2 * per_request + per_request // 2  # room for two requests, not three
    quotas = {
        "alpha": Quotas(),
        "beta": Quotas(),
        "rpm": Quotas(requests_per_minute=3),
        "budget": Quotas(monthly_token_budget=budget),
    }

    async def create() -> dict[str, str]:
        return {
            name: (await create_tenant(url, spool, name, q, keys=1))[0]
            for name, q in quotas.items()
        }

    return asyncio.run(create())


def _chat(text: str) -> list[ChatCompletionMessageParam]:
    return [{"role": "user", "content": text}]


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    if router_binary() is None:
        pytest.skip("the smg router binary is not installed (pip install smg==1.13.0)")
    tmp = tmp_path_factory.mktemp("cluster")
    model = str(tiny_llama_dir)
    tokenizer = Tokenizer.from_dir(tiny_llama_dir)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "budget"}]
    per_request = len(tokenizer.apply_chat_template(messages)) + MAX_TOKENS_BUDGET
    engine_env = {"ATRIUM_DTYPE": "float32", "ATRIUM_KV_CACHE_BYTES": str(8 * 2**20),
                  "ATRIUM_TORCH_THREADS": "1", "ATRIUM_LOG_LEVEL": "warning",
                  "ATRIUM_DRAIN_GRACE_S": "1"}  # fmt: skip
    servers: list[Server] = []
    with migrated_database() as name:
        url = pg_url(name)
        keys = _tenants(url, tmp / "setup.spool", per_request)
        try:
            gateway_ports = [free_port(), free_port()]
            feed = f"http://127.0.0.1:{gateway_ports[0]}"  # where engines fetch public prefixes
            engines = [
                start_engine(model, free_port(), TOKEN, tmp, engine_env, gateway_url=feed)
                for _ in range(2)
            ]
            servers += engines
            wait_all(engines, "/health")
            urls = [e.base_url for e in engines]
            # No warm-up diversions: smg would send one cache hit in eight to an idle engine.
            calm = ("--worker-warmup-secs", "0", "--worker-warmup-divert-every", "0")
            router = start_router(urls, free_port(), free_port(), TOKEN, tmp, extra=calm)
            servers.append(router)
            wait_workers(router, TOKEN, 2)
            gateways = []
            for n in range(2):
                env = {"ATRIUM_DATABASE_URL": url, "ATRIUM_ADMIN_TOKEN": ADMIN_TOKEN,
                       "ATRIUM_USAGE_SPOOL_PATH": str(tmp / f"gw{n}.spool"),
                       "ATRIUM_LOG_LEVEL": "warning", "ATRIUM_DRAIN_GRACE_S": "1"}  # fmt: skip
                gateways.append(
                    start_gateway(model, gateway_ports[n], router.base_url, TOKEN, env, tmp)
                )
            servers += gateways
            wait_all(gateways, "/readyz")
            served = httpx.get(f"{urls[0]}/v1/models", headers={"Authorization": f"Bearer {TOKEN}"})

            def restart(port: int) -> Server:
                server = start_engine(model, port, TOKEN, tmp, engine_env, gateway_url=feed)
                servers.append(server)
                return server

            yield Cluster(engines, router, gateways, url, keys,
                          served.json()["data"][0]["id"], tokenizer, restart)  # fmt: skip
        finally:
            stop_all(servers)


def test_requests_flow_through_both_gateways(cluster: Cluster) -> None:
    for gateway in (0, 1):
        answer = cluster.client("alpha", gateway).chat.completions.create(
            model=cluster.model, messages=_chat("hello"), max_tokens=4
        )
        assert answer.choices[0].finish_reason in ("stop", "length")
        assert answer.usage is not None and answer.usage.completion_tokens > 0
    stream = cluster.client("alpha", 1).completions.create(
        model=cluster.model, prompt="count with me", max_tokens=5, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5
    scored = cluster.client("alpha", 0).completions.create(
        model=cluster.model, prompt="count with me", max_tokens=3, logprobs=2,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    logprobs = scored.choices[0].logprobs
    assert logprobs is not None and logprobs.token_logprobs is not None
    assert len(logprobs.token_logprobs) == 3 and all(lp <= 0 for lp in logprobs.token_logprobs)
    with pytest.raises(openai.BadRequestError, match="context length"):  # the engines' limit
        cluster.client("alpha", 0).completions.create(
            model=cluster.model, prompt="word " * 1200, max_tokens=5
        )


def test_prefix_cache_is_reused_per_tenant_only(cluster: Cluster) -> None:
    def cached(tenant: str, gateway: int) -> int:
        answer = cluster.client(tenant, gateway).chat.completions.create(
            model=cluster.model, messages=_chat(LONG), max_tokens=2
        )
        assert answer.usage is not None and answer.usage.prompt_tokens_details is not None
        return int(answer.usage.prompt_tokens_details.cached_tokens or 0)

    assert cached("alpha", 0) == 0
    assert cached("alpha", 1) > 0  # the other gateway, wherever the router placed it
    assert cached("beta", 0) == 0  # the same text, another tenant: nothing shared


def test_rate_and_budget_quotas_hold_across_gateways(cluster: Cluster) -> None:
    def send(tenant: str, gateway: int) -> int:
        try:
            cluster.client(tenant, gateway).chat.completions.create(
                model=cluster.model, messages=_chat("budget"), max_tokens=MAX_TOKENS_BUDGET,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
        except openai.RateLimitError:
            return 429
        return 200

    assert [send("rpm", g) for g in (0, 1, 0)] == [200, 200, 200]
    assert [send("rpm", g) for g in (1, 0)] == [429, 429]
    assert [send("budget", g) for g in (0, 1)] == [200, 200]
    assert [send("budget", g) for g in (0, 1)] == [429, 429]


def test_a_published_prefix_reaches_every_engine(cluster: Cluster) -> None:
    text = "Preamble every tenant of this deployment shares, published once. " * 5
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    published = httpx.post(f"{cluster.gateways[1].base_url}/admin/v1/public-prefixes",
                           json={"text": text}, headers=admin, timeout=30)  # fmt: skip
    assert published.status_code == 201, published.text
    engine_auth = {"Authorization": f"Bearer {TOKEN}"}
    deadline = time.monotonic() + 30  # engines poll the gateway every 5 s
    for n, engine in enumerate(cluster.engines):
        for attempt in range(1000):
            body = {
                "model": cluster.model,
                "prompt": text + "Question?",
                "max_tokens": 1,
                "cache_salt": f"fresh-{n}-{attempt}",
            }  # a namespace that has seen nothing
            answer = httpx.post(f"{engine.base_url}/v1/completions", json=body,
                                headers=engine_auth, timeout=30)  # fmt: skip
            if answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0:
                break
            assert time.monotonic() < deadline, f"{engine.base_url} never got the prefix"
            time.sleep(0.5)


def test_the_engine_view_lists_every_engine(cluster: Cluster) -> None:
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    state = httpx.get(f"{cluster.gateways[1].base_url}/admin/v1/engine", headers=admin).json()
    engines = state["engines"]
    assert sorted(e["url"] for e in engines) == sorted(e.base_url for e in cluster.engines)
    assert all(e["healthy"] for e in engines)
    assert state["kv_pages_total"] == sum(e["kv_pages_total"] for e in engines) > 0
    named = {t["tenant_name"] for t in state["tenants"]}
    assert {"alpha", "beta"} <= named  # their cached pages, summed over the engines


def _counters(engine: Server) -> dict[str, int]:
    state = httpx.get(f"{engine.base_url}/atrium/v1/state",
                      headers={"Authorization": f"Bearer {TOKEN}"}).json()  # fmt: skip
    counters: dict[str, int] = state["counters"]
    return counters


def test_n_choices_land_on_one_engine_that_computes_the_prompt_once(cluster: Cluster) -> None:
    prompt = "Three takes on one question, all from the engine the router picks. " * 2
    before = [_counters(engine) for engine in cluster.engines]
    answer = cluster.client("alpha", 1).completions.create(
        model=cluster.model, prompt=prompt, n=3, max_tokens=4, temperature=1.0, seed=9,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert sorted(c.index for c in answer.choices) == [0, 1, 2]
    assert len({c.text for c in answer.choices}) > 1  # seeds 9, 10, 11
    num_prompt = len(cluster.tokenizer.encode(prompt))
    assert answer.usage is not None
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (num_prompt, 12)
    deadline = time.monotonic() + 10  # an engine's snapshot follows its answer by a moment
    while True:
        after = [_counters(engine) for engine in cluster.engines]
        ended = [a["num_finished"] - b["num_finished"] for a, b in zip(after, before, strict=True)]
        if sum(ended) >= 3 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert sorted(ended) == [0, 3]  # one engine ran the three choices
    (used,) = [n for n, count in enumerate(ended) if count == 3]
    reused = (num_prompt - 1) // 16 * 16  # the prompt's full pages, computed once
    cached = after[used]["num_cached_tokens"] - before[used]["num_cached_tokens"]
    computed = after[used]["num_prefill_tokens"] - before[used]["num_prefill_tokens"]
    assert cached == 2 * reused > 0
    assert computed == num_prompt + 2 * (num_prompt - reused)


def _busy_engine(cluster: Cluster) -> Server:
    for engine in cluster.engines:
        text = httpx.get(f"{engine.base_url}/metrics",
                         headers={"Authorization": f"Bearer {TOKEN}"}).text  # fmt: skip
        running = [line for line in text.splitlines()
                   if line.startswith("vllm:num_requests_running")]  # fmt: skip
        if running and float(running[0].split()[-1]) >= 1:
            return engine
    raise AssertionError("no engine is running the request")


async def _usage_row(url: str, request_id: str) -> list[UsageEventRow]:
    db = await Database.connect(url)
    try:
        async with db.sessions() as session:
            query = select(UsageEventRow).where(UsageEventRow.request_id == request_id)
            return list(await session.scalars(query))
    finally:
        await db.close()


def test_engine_killed_mid_stream_is_metered_once_and_the_other_serves(cluster: Cluster) -> None:
    body = {
        "model": cluster.model,
        "prompt": "tell a long story",
        "max_tokens": 1000,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {"Authorization": f"Bearer {cluster.keys['alpha']}"}
    events: list[dict[str, object]] = []
    url = f"{cluster.gateways[0].base_url}/v1/completions"
    with httpx.stream("POST", url, json=body, headers=headers, timeout=60) as answer:
        request_id = answer.headers["x-request-id"]
        lines = answer.iter_lines()
        for line in lines:
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
                break
        victim = _busy_engine(cluster)
        os.killpg(os.getpgid(victim.process.pid), signal.SIGKILL)
        for line in lines:
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
    errors = [e for e in events if "error" in e]
    assert len(errors) == 1
    usage = events[-1]["usage"]
    assert isinstance(usage, dict) and 0 < usage["completion_tokens"] < 1000
    deadline = time.monotonic() + 10
    rows = asyncio.run(_usage_row(cluster.db_url, request_id))
    while not rows and time.monotonic() < deadline:
        time.sleep(0.2)
        rows = asyncio.run(_usage_row(cluster.db_url, request_id))
    assert [(r.status, r.completion_tokens) for r in rows] == [
        ("error", usage["completion_tokens"])
    ]
    for n in range(3):
        later = cluster.client("alpha", n % 2).chat.completions.create(
            model=cluster.model, messages=_chat(f"still there {n}?"), max_tokens=3
        )
        assert later.usage is not None and later.usage.completion_tokens > 0


def test_a_restarted_engine_rejoins(cluster: Cluster) -> None:
    (dead,) = [e for e in cluster.engines if e.process.poll() is not None]
    port = int(dead.base_url.rsplit(":", 1)[1])
    back = cluster.restart(port)
    wait_all([back], "/health")
    wait_workers(cluster.router, TOKEN, 2, timeout_s=30)
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    state = httpx.get(f"{cluster.gateways[0].base_url}/admin/v1/engine", headers=admin).json()
    assert sorted((e["url"], e["healthy"]) for e in state["engines"]) == sorted(
        (e.base_url, True) for e in cluster.engines
    )


def test_engines_refuse_callers_without_the_engine_token(cluster: Cluster) -> None:
    live = [e for e in cluster.engines if e.process.poll() is None]
    body = {"model": cluster.model, "prompt": "hi", "max_tokens": 2, "cache_salt": "alpha"}
    for headers in ({}, {"Authorization": f"Bearer {cluster.keys['alpha']}"}):
        answer = httpx.post(f"{live[0].base_url}/v1/completions", json=body, headers=headers)
        assert answer.status_code == 401
    books = asyncio.run(read_books(cluster.db_url))
    assert len(books.request_ids) == len(set(books.request_ids))
    assert books.reservations == 0
