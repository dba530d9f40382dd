"""A request's ``n`` choices through a gateway to engine servers over HTTP, behind a router whose
policy ignores prefixes: the same choices, usage and billing as the in-process server, each
prompt placed whole on one engine and computed there once (its other choices served from the
prefix cache), and a client gone aborting every choice."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from litestar import Litestar
from litestar.testing import TestClient
from prometheus_client.parser import text_string_to_metric_families

from engine.tokenizer import Tokenizer
from tests.integration.gateway_fakes import KEY_A, make_tenancy, settings
from tests.integration.test_gateway_disconnect import stream_then_leave
from tests.support.serve import serving_on_thread
from web.app import create_app
from web.engine_api import create_engine_app
from web.engine_api.client import HttpEngineClient
from web.openai.generation import ModelRuntime
from web.tenancy.principal import InMemoryTenancy

TOKEN = "engine-choices-token"
AUTH = {"Authorization": f"Bearer {KEY_A}"}
ENGINE_AUTH = {"Authorization": f"Bearer {TOKEN}"}
ENGINE = {"dtype": "float32", "device": "cpu", "kv_cache_bytes": 8 * 2**20, "engine_process": False}
PREFIX_CACHE = ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits")  # counted in tokens
Client = TestClient[Litestar]


class RoundRobinRouter(httpx.AsyncBaseTransport):
    """A router whose policy ignores prefixes: each generation goes to the next engine in turn
    (anything else to the first). ``placed`` counts the generations each engine was sent."""

    def __init__(self, urls: list[str]) -> None:
        self.urls = [httpx.URL(url) for url in urls]
        self.placed = [0] * len(urls)
        self.forward = httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        engine = 0
        if request.method == "POST":
            engine = sum(self.placed) % len(self.urls)
            self.placed[engine] += 1
        target = self.urls[engine]
        url = request.url.copy_with(scheme=target.scheme, host=target.host, port=target.port)
        sent = httpx.Request(request.method, url, headers=request.headers, stream=request.stream)
        return await self.forward.handle_async_request(sent)

    async def aclose(self) -> None:
        await self.forward.aclose()


Remote = tuple[Client, InMemoryTenancy, RoundRobinRouter]  # a gateway, its books, its router
Local = tuple[Client, InMemoryTenancy]  # the in-process server, its books


@pytest.fixture(scope="module")
def engine_urls(tiny_llama_dir: Path) -> Iterator[list[str]]:
    config = settings(model=str(tiny_llama_dir), role="engine", engine_token=TOKEN, **ENGINE)
    with (
        serving_on_thread(create_engine_app(config)) as first,
        serving_on_thread(create_engine_app(config)) as second,
    ):
        yield [first, second]


def card_of(engine_urls: list[str]) -> dict[str, Any]:
    """The model as the engines describe it (``/v1/models``)."""
    card: dict[str, Any] = httpx.get(f"{engine_urls[0]}/v1/models", headers=ENGINE_AUTH).json()[
        "data"
    ][0]
    return card


def gateway_app(
    tiny_llama_dir: Path, engine_urls: list[str], tenancy: InMemoryTenancy
) -> tuple[Litestar, RoundRobinRouter]:
    """A gateway whose engine client reaches the engines through the router, serving the model
    as the engines describe it."""
    card = card_of(engine_urls)
    tokenizer = Tokenizer.from_dir(tiny_llama_dir)
    router = RoundRobinRouter(engine_urls)
    client = HttpEngineClient("http://router.test", TOKEN, tokenizer, card["id"], transport=router)
    runtime = ModelRuntime(card["id"], client, tokenizer, card["max_model_len"],
                           kv_capacity_tokens=card["kv_capacity_tokens"])  # fmt: skip
    app = create_app(settings(), engine=runtime, store=tenancy, include_admin=False)
    app.on_shutdown.append(client.shutdown)
    return app, router


@pytest.fixture(scope="module")
def remote(tiny_llama_dir: Path, engine_urls: list[str]) -> Iterator[Remote]:
    tenancy = make_tenancy()
    app, router = gateway_app(tiny_llama_dir, engine_urls, tenancy)
    with TestClient(app) as client:
        yield client, tenancy, router


@pytest.fixture(scope="module")
def local(tiny_llama_dir: Path) -> Iterator[Local]:
    tenancy = make_tenancy()
    app = create_app(settings(model=str(tiny_llama_dir), **ENGINE), store=tenancy,
                     include_admin=False)  # fmt: skip
    with TestClient(app) as client:
        yield client, tenancy


def model_of(client: Client) -> str:
    return str(client.get("/v1/models", headers=AUTH).json()["data"][0]["id"])


Counters = Callable[[], dict[str, float]]


def engine_counters(urls: list[str]) -> Counters:
    """The engine servers' counters summed (their states' and their prefix-cache metrics), with
    the requests each one has ended as ``ended@<its index>``."""

    def read() -> dict[str, float]:
        total: dict[str, float] = {}
        for index, url in enumerate(urls):
            state = httpx.get(f"{url}/atrium/v1/state", headers=ENGINE_AUTH).json()
            text = httpx.get(f"{url}/metrics", headers=ENGINE_AUTH).text
            families = {f.name: f for f in text_string_to_metric_families(text)}
            one = {**state["counters"], "queries": families[PREFIX_CACHE[0]].samples[0].value,
                   "hits": families[PREFIX_CACHE[1]].samples[0].value}  # fmt: skip
            for name, value in one.items():
                total[name] = total.get(name, 0) + value
            total[f"ended@{index}"] = one["num_finished"] + one["num_aborted"]
        return total

    return read


def local_counters(client: Client) -> Counters:
    """The in-process server's engine counters."""

    def read() -> dict[str, float]:
        counters = client.app.state.engine.stats().counters
        return {name: getattr(counters, name) for name in counters.__dataclass_fields__}

    return read


def ended(read: Counters, before: dict[str, float], requests: int) -> dict[str, float]:
    """The counters' changes since ``before`` once ``requests`` more engine requests have ended
    (the engine's snapshot is taken when it goes idle, a moment after the answer)."""
    deadline = time.monotonic() + 10
    while True:
        now = read()
        changed = {name: now[name] - before[name] for name in before}
        if changed["num_finished"] + changed["num_aborted"] >= requests:
            return changed
        assert time.monotonic() < deadline, "the engine's snapshot never caught up"
        time.sleep(0.02)


def streamed(client: Client, body: dict[str, Any]) -> dict[str, Any]:
    """A streamed answer put together per choice: texts, finish reasons, logprobs, usage."""
    answer = client.post("/v1/completions", json={**body, "stream": True,
                         "stream_options": {"include_usage": True}}, headers=AUTH)  # fmt: skip
    assert answer.status_code == 200, answer.text
    frames = [f.removeprefix("data: ") for f in answer.text.split("\n\n") if f]
    assert frames[-1] == "[DONE]"
    chunks = [json.loads(f) for f in frames[:-1]]
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    logprobs: dict[int, list[tuple[str, float]]] = {}
    for chunk in chunks:
        assert "error" not in chunk, chunk
        for choice in chunk["choices"]:
            index = choice["index"]
            texts[index] = texts.get(index, "") + choice["text"]
            if choice["finish_reason"]:
                reasons[index] = choice["finish_reason"]
            if choice.get("logprobs"):
                scored = choice["logprobs"]
                pairs = zip(scored["tokens"], scored["token_logprobs"], strict=True)
                logprobs.setdefault(index, []).extend(pairs)
    return {"texts": texts, "reasons": reasons, "logprobs": logprobs, "usage": chunks[-1]["usage"]}


def placed_on_one_engine(changed: dict[str, float], requests: int) -> None:
    assert sorted(changed[key] for key in changed if key.startswith("ended@")) == [0, requests]


def test_greedy_choices_match_in_process_and_the_prompt_is_computed_once(
    remote: Remote, local: Local, engine_urls: list[str]
) -> None:
    prompt = "Summarise the policy on shared pages, in a few short words, for the team: "
    body = {"prompt": prompt, "n": 3, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    router = remote[2]
    answers, computed = [], []
    for client, read in (
        (remote[0], engine_counters(engine_urls)),
        (local[0], local_counters(local[0])),
    ):
        before, placed = read(), sum(router.placed)
        answer = client.post("/v1/completions", json={**body, "model": model_of(client)},
                             headers=AUTH)  # fmt: skip
        assert answer.status_code == 200, answer.text
        answers.append(answer.json())
        computed.append(ended(read, before, 3))
        if client is remote[0]:
            assert sum(router.placed) - placed == 1  # one engine request for the three
    (through, inside), (engines, in_process) = answers, computed
    assert [c["index"] for c in through["choices"]] == [0, 1, 2]
    assert through["choices"] == inside["choices"]
    assert through["usage"] == inside["usage"]
    num_prompt = through["usage"]["prompt_tokens"]
    assert num_prompt == len(prompt)  # one token per byte: counted once, not three times
    assert through["usage"]["completion_tokens"] == 18
    # On one engine, as in process, the first choice computed the prompt and the two others
    # found its full pages cached, computing only their last partial page.
    placed_on_one_engine(engines, 3)
    page = 16
    reused = (num_prompt - 1) // page * page
    assert engines["num_cached_tokens"] == in_process["num_cached_tokens"] == 2 * reused > 0
    assert engines["num_prefill_tokens"] == in_process["num_prefill_tokens"]
    assert engines["num_prefill_tokens"] == num_prompt + 2 * (num_prompt - reused)
    # The metrics routers and dashboards read say the same (counted in tokens, as vLLM does).
    assert engines["hits"] == engines["num_cached_tokens"]
    assert engines["queries"] - engines["hits"] == engines["num_prefill_tokens"]
    books = [remote[1].usage[-1], local[1].usage[-1]]
    keyed = [(b.status, b.prompt_tokens, b.cached_tokens, b.completion_tokens) for b in books]
    assert keyed[0] == keyed[1] == ("ok", num_prompt, 0, 18)


def test_seeded_streamed_choices_match_in_process_with_their_own_ends_and_logprobs(
    remote: Remote, local: Local
) -> None:
    body = {"prompt": "Once upon a time, in a tiny random model,", "n": 3, "max_tokens": 12,
            "temperature": 1.0, "seed": 11, "logprobs": 2, "stop": ["r"]}  # fmt: skip
    placed = sum(remote[2].placed)
    through = streamed(remote[0], {**body, "model": model_of(remote[0])})
    inside = streamed(local[0], {**body, "model": model_of(local[0])})
    assert sum(remote[2].placed) - placed == 1
    assert sorted(through["texts"]) == [0, 1, 2]
    assert through["texts"] == inside["texts"]
    assert len(set(through["texts"].values())) > 1  # each choice has its own seed
    assert through["reasons"] == inside["reasons"]
    assert set(through["reasons"].values()) == {"stop", "length"}  # each choice its own end
    assert through["logprobs"].keys() == inside["logprobs"].keys() == {0, 1, 2}
    for index, scored in inside["logprobs"].items():
        assert [token for token, _ in through["logprobs"][index]] == [t for t, _ in scored]
        got = [logprob for _, logprob in through["logprobs"][index]]
        assert got == pytest.approx([logprob for _, logprob in scored], abs=1e-6)
    assert through["usage"] == inside["usage"]
    books = [remote[1].usage[-1], local[1].usage[-1]]
    keyed = [(b.status, b.prompt_tokens, b.cached_tokens, b.completion_tokens) for b in books]
    assert keyed[0] == keyed[1]
    assert keyed[0][3] == through["usage"]["completion_tokens"]


def test_seeded_chat_choices_match_in_process(remote: Remote, local: Local) -> None:
    body = {"messages": [{"role": "user", "content": "Name three colours."}], "n": 2,
            "max_tokens": 8, "temperature": 0.8, "seed": 5}  # fmt: skip
    answers = []
    placed = sum(remote[2].placed)
    for client in (remote[0], local[0]):
        answer = client.post("/v1/chat/completions", json={**body, "model": model_of(client)},
                             headers=AUTH)  # fmt: skip
        assert answer.status_code == 200, answer.text
        answers.append(answer.json())
    assert sum(remote[2].placed) - placed == 1
    through, inside = answers
    assert through["choices"] == inside["choices"]
    assert through["usage"] == inside["usage"]


def test_a_client_gone_aborts_every_choice_on_the_engine(
    tiny_llama_dir: Path, engine_urls: list[str]
) -> None:
    tenancy = make_tenancy()
    app, router = gateway_app(tiny_llama_dir, engine_urls, tenancy)  # on this test's own loop
    body = {"model": card_of(engine_urls)["id"], "n": 3, "max_tokens": 200,
            "messages": [{"role": "user", "content": "go on"}], "ignore_eos": True,
            "stream": True}  # fmt: skip
    read = engine_counters(engine_urls)
    before = read()
    received = asyncio.run(stream_then_leave(app, body, keep_chunks=8))
    assert b"[DONE]" not in b"".join(received)
    changed = ended(read, before, 3)
    assert (changed["num_aborted"], changed["num_finished"]) == (3, 0)
    placed_on_one_engine(changed, 3)
    assert sum(router.placed) == 1
    [usage] = tenancy.usage
    assert usage.status == "disconnect"
    assert 3 <= usage.completion_tokens < 600
