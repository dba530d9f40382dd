""" "The gateway over an engine reached by HTTP (``HttpEngineClient``), with scripted engine
answers: what the tenant sees and what is metered when the engine refuses, is unreachable, or
is cut off mid-stream; readiness and engine counters as the engines come and go."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
from litestar.testing import TestClient

from engine.stats import EngineSnapshot, EngineStats
from engine.tokenizer import Tokenizer
from tests.integration.gateway_fakes import KEY_A, make_tenancy, settings
from tests.support.serve import free_port
from web.app import create_app
from web.engine_api.client import LOST, HttpEngineClient
from web.engine_api.fleet import Fleet
from web.engine_api.local import engine_numbers
from web.engine_api.wire import STATE_PATH
from web.openai.generation import ModelRuntime
from web.tenancy.principal import InMemoryTenancy

AUTH = {"Authorization": f"Bearer {KEY_A}"}
MODEL = "tiny-remote"
Handler = Callable[[httpx.Request], httpx.Response]


def frame(text: str, completion: int, finish: str | None = None, prompt: int = 7) -> bytes:
    chunk = {
        "choices": [{"index": 0, "text": text, "finish_reason": finish}],
        "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                  "prompt_tokens_details": {"cached_tokens": 3}},
    }  # fmt: skip
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


class CutStream(httpx.AsyncByteStream):
    """Sends ``frames``, then fails as a connection reset would (or ends, with ``clean``)."""

    def __init__(self, frames: list[bytes], clean: bool = False) -> None:
        self.frames = frames
        self.clean = clean

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for item in self.frames:
            yield item
        if not self.clean:
            raise httpx.ReadError("connection reset")


def gateway(  # type: ignore[type-arg]
    tiny_llama_dir: Path,
    handler: Handler,
    url: str = "http://engine.test",
    poll_s: float | None = None,
) -> TestClient:
    """A gateway over ``handler``'s engine; with ``poll_s``, polling its state that often (as
    the gateway role's fleet does)."""
    tokenizer = Tokenizer.from_dir(tiny_llama_dir)
    seen: list[dict[str, object]] = []

    def record(request: httpx.Request) -> httpx.Response:
        if request.method == "POST":  # a generation (the fleet polls with GETs)
            seen.append(json.loads(request.content))
        assert request.headers["authorization"] == "Bearer engine-secret"
        return handler(request)

    transport = httpx.MockTransport(record) if url == "http://engine.test" else None
    client = HttpEngineClient(url, "engine-secret", tokenizer, MODEL, transport=transport)
    runtime = ModelRuntime(MODEL, client, tokenizer, max_model_len=256)
    if poll_s is not None:
        runtime.stats = lambda: engine_numbers(client.stats())  # as the gateway role's
    app = create_app(settings(), engine=runtime, store=make_tenancy(), include_admin=False)
    app.state.sent = seen
    if poll_s is not None:
        client.fleet = Fleet(client, interval_s=poll_s)
        app.on_startup.append(client.fleet.start)
        app.on_shutdown.append(client.fleet.stop)
    return TestClient(app)


def completion(client: TestClient, stream: bool = True) -> httpx.Response:  # type: ignore[type-arg]
    body = {"model": MODEL, "prompt": "hello world", "max_tokens": 5, "stream": stream,
            "stream_options": {"include_usage": True}}  # fmt: skip
    return client.post("/v1/completions", json=body, headers=AUTH)


def tenancy_of(client: TestClient) -> InMemoryTenancy:  # type: ignore[type-arg]
    tenancy: InMemoryTenancy = client.app.state.tenancy
    return tenancy


@pytest.fixture
def ok_engine() -> Handler:
    frames = [frame("a", 1), frame("b", 2), frame("", 2, "length"), b"data: [DONE]\n\n"]
    return lambda request: httpx.Response(200, stream=CutStream(frames, clean=True))


def test_the_engine_gets_ids_text_and_tenant_fields(
    tiny_llama_dir: Path, ok_engine: Handler
) -> None:
    with gateway(tiny_llama_dir, ok_engine) as client:
        answer = completion(client, stream=False)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["text"] == "ab"
        usage = answer.json()["usage"]
        assert usage["completion_tokens"] == 2
        assert usage["prompt_tokens_details"]["cached_tokens"] == 3
        sent = client.app.state.sent[0]
        record = tenancy_of(client).usage[0]
    tokenizer = Tokenizer.from_dir(tiny_llama_dir)
    assert sent["atrium_prompt_token_ids"] == tokenizer.encode("hello world")
    assert sent["prompt"] == "hello world"
    assert sent["cache_salt"] == "tenant-a"
    assert sent["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert sent["atrium_sampling"]["max_tokens"] == 5  # type: ignore[index]
    assert (record.status, record.completion_tokens, record.cached_tokens) == ("ok", 2, 3)


def test_unreachable_engine_is_503_with_retry_after(tiny_llama_dir: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with gateway(tiny_llama_dir, lambda r: httpx.Response(500), url=dead) as client:
        answer = completion(client)
        records = tenancy_of(client).usage
    assert answer.status_code == 503
    assert answer.headers["retry-after"] == "1"
    assert answer.json()["error"]["code"] == "engine_dead"
    assert [(r.status, r.prompt_tokens, r.completion_tokens) for r in records] == [
        ("unavailable", 0, 0)
    ]


@pytest.mark.parametrize("status", [500, 502, 503, 404])
def test_router_refusals_are_503(tiny_llama_dir: Path, status: int) -> None:
    with gateway(tiny_llama_dir, lambda r: httpx.Response(status, json={})) as client:
        answer = completion(client)
    assert answer.status_code == 503
    assert "retry-after" in answer.headers


def test_engine_400_keeps_its_message_and_param(tiny_llama_dir: Path) -> None:
    error = {"error": {"message": "stop is bad", "param": "stop", "code": "invalid_request"}}
    with gateway(tiny_llama_dir, lambda r: httpx.Response(400, json=error)) as client:
        answer = completion(client)
        records = tenancy_of(client).usage
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == "stop"
    assert [r.status for r in records] == ["rejected"]


@pytest.mark.parametrize("clean", [False, True])
def test_cut_mid_stream_ends_with_an_error_event_and_meters_what_was_sent(
    tiny_llama_dir: Path, clean: bool
) -> None:
    frames = [frame("a", 1), frame("bc", 3)]
    handler: Handler = lambda request: httpx.Response(200, stream=CutStream(frames, clean))  # noqa: E731
    with gateway(tiny_llama_dir, handler) as client:
        answer = completion(client)
        records = tenancy_of(client).usage
    events = [f.removeprefix("data: ") for f in answer.text.split("\n\n") if f]
    assert events[-1] == "[DONE]"
    payloads = [json.loads(e) for e in events[:-1]]
    assert "".join(p["choices"][0]["text"] for p in payloads if p.get("choices")) == "abc"
    errors = [p["error"] for p in payloads if "error" in p]
    assert [e["message"] for e in errors] == [LOST]
    assert payloads[-1]["usage"]["completion_tokens"] == 3
    assert [(r.status, r.completion_tokens) for r in records] == [("error", 3)]


def test_router_error_event_ends_the_stream_once(tiny_llama_dir: Path) -> None:
    lost = b'data: {"error": {"message": "Stream error: unexpected EOF"}}\n\n'
    frames = [frame("a", 1), lost, b"data: [DONE]\n\n"]
    handler: Handler = lambda request: httpx.Response(200, stream=CutStream(frames, True))  # noqa: E731
    with gateway(tiny_llama_dir, handler) as client:
        answer = completion(client)
        records = tenancy_of(client).usage
    assert answer.text.count('"error"') == 1
    assert "unexpected EOF" not in answer.text  # the router's words stay in the log
    assert [(r.status, r.completion_tokens) for r in records] == [("error", 1)]


def test_logprobs_cross_by_token_id(tiny_llama_dir: Path) -> None:
    tokenizer = Tokenizer.from_dir(tiny_llama_dir)
    a, b = tokenizer.encode("a")[0], tokenizer.encode("b")[0]
    first = json.loads(frame("a", 1)[6:])
    first["atrium_logprobs"] = [[a, -0.25, [[a, -0.25], [b, -2.0]]]]
    second = json.loads(frame("b", 2, "length")[6:])
    second["atrium_logprobs"] = [[b, -0.5, [[b, -0.5], [a, -1.5]]]]
    frames = [b"data: " + json.dumps(c).encode() + b"\n\n" for c in (first, second)]
    handler: Handler = lambda request: httpx.Response(  # noqa: E731
        200, stream=CutStream([*frames, b"data: [DONE]\n\n"], clean=True)
    )
    with gateway(tiny_llama_dir, handler) as client:
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 2, "logprobs": 1}
        answer = client.post("/v1/completions", json=body, headers=AUTH)
        sent = client.app.state.sent[0]
    assert answer.status_code == 200, answer.text
    logprobs = answer.json()["choices"][0]["logprobs"]
    assert logprobs["token_logprobs"] == [-0.25, -0.5]
    assert logprobs["tokens"] == ["a", "b"]
    assert sent["atrium_sampling"]["logprobs"] == 1


def _preemptions(client: TestClient) -> float:  # type: ignore[type-arg]
    text = client.get("/metrics").text
    (line,) = [x for x in text.splitlines() if x.startswith("atrium_engine_preemptions_total ")]
    return float(line.split()[1])


def _wait(predicate: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 10
    while not predicate():
        assert time.monotonic() < deadline, "the engines' state was never polled"
        time.sleep(0.02)


def test_readyz_follows_the_engines_and_engine_counters_never_go_back(
    tiny_llama_dir: Path,
) -> None:
    engine: dict[str, int | None] = {"preemptions": 5}  # None: the engine does not answer

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == STATE_PATH and engine["preemptions"] is not None:
            counters = EngineStats(num_preemptions=engine["preemptions"])
            return httpx.Response(
                200, content=msgspec.json.encode(EngineSnapshot(counters=counters))
            )
        return httpx.Response(503)  # no worker list: the URL is one engine, and it is down

    client = gateway(tiny_llama_dir, handler, poll_s=0.02)

    def readyz() -> tuple[int, object]:
        answer = client.get("/readyz")
        return answer.status_code, answer.json()["engine_running"]

    with client:
        _wait(lambda: readyz() == (200, True))
        assert _preemptions(client) == 5
        engine["preemptions"] = None  # down (or a missed poll): not ready, nothing counted
        _wait(lambda: readyz() == (503, False))
        assert _preemptions(client) == 5
        engine["preemptions"] = 6  # back, still counting from where it was
        _wait(lambda: readyz() == (200, True) and _preemptions(client) == 6)
        engine["preemptions"] = 2  # restarted: counting anew, on top of what was counted
        _wait(lambda: _preemptions(client) == 8)


def choice_frame(
    index: int, text: str, completion: int, finish: str | None = None, cached: int = 3
) -> bytes:
    """A chunk of one choice of a stream of several: its own counts in ``atrium_choice_usage``
    (the stream's ``usage`` counts the prompt once and sums the choices)."""
    chunk = {
        "choices": [{"index": index, "text": text, "finish_reason": finish}],
        "usage": {"prompt_tokens": 7, "completion_tokens": 99, "prompt_tokens_details": {}},
        "atrium_choice_usage": {"index": index, "completion_tokens": completion,
                                "cached_tokens": cached},
    }  # fmt: skip
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


def payloads(answer: httpx.Response) -> list[dict[str, Any]]:
    events = [f.removeprefix("data: ") for f in answer.text.split("\n\n") if f]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def texts_by_choice(chunks: list[dict[str, Any]]) -> dict[int, str]:
    texts: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk.get("choices") or ():
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    return texts


def two_seeded_choices(
    tiny_llama_dir: Path, handler: Handler
) -> tuple[httpx.Response, list[dict[str, Any]], list[Any], list[tuple[int, str, str]]]:
    """A completion of two choices (seed 4) through ``handler``'s engine: the answer (200), the
    engine requests sent, the usage records, and each choice's index, text and finish."""
    with gateway(tiny_llama_dir, handler) as client:
        body = {"model": MODEL, "prompt": "hello world", "max_tokens": 5, "n": 2, "seed": 4}
        answer = client.post("/v1/completions", json=body, headers=AUTH)
        sent = client.app.state.sent
        records = tenancy_of(client).usage
    assert answer.status_code == 200, answer.text
    choices = [(c["index"], c["text"], c["finish_reason"]) for c in answer.json()["choices"]]
    return answer, sent, records, choices


def test_n_choices_cross_as_one_request_split_back_by_index(tiny_llama_dir: Path) -> None:
    frames = [
        choice_frame(0, "a", 1),
        choice_frame(1, "x", 1, cached=16),  # its prompt pages came from choice 0
        choice_frame(1, "y", 2, "stop", cached=16),
        choice_frame(0, "b", 2),
        choice_frame(0, "", 2, "length"),
        b"data: [DONE]\n\n",
    ]
    handler: Handler = lambda request: httpx.Response(200, stream=CutStream(frames, clean=True))  # noqa: E731
    answer, sent, records, choices = two_seeded_choices(tiny_llama_dir, handler)
    assert choices == [(0, "ab", "length"), (1, "xy", "stop")]
    (one,) = sent  # one engine request for the prompt's two choices
    assert one["n"] == 2
    assert one["atrium_sampling"]["seed"] == 4  # the first choice's; the engine makes seed + 1
    usage = answer.json()["usage"]
    prompt = len(Tokenizer.from_dir(tiny_llama_dir).encode("hello world"))
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (prompt, 4)
    assert usage["prompt_tokens_details"]["cached_tokens"] == 3  # the prompt once: choice 0's
    assert [(r.status, r.prompt_tokens, r.cached_tokens, r.completion_tokens)
            for r in records] == [("ok", prompt, 3, 4)]  # fmt: skip


LOST_FOR_ALL = b'data: {"error": {"message": "Stream error: unexpected EOF"}}\n\n'


@pytest.mark.parametrize(
    ("frames", "clean", "finishes", "billed"),
    [
        # Cut off while both run: each ends with an error, billed what it delivered.
        ([choice_frame(0, "a", 1), choice_frame(1, "xy", 2), choice_frame(0, "bc", 3)],
         False, {0: None, 1: None}, 5),
        # The same, cleanly closed without saying how the choices ended.
        ([choice_frame(0, "a", 1), choice_frame(1, "xy", 2), choice_frame(0, "bc", 3)],
         True, {0: None, 1: None}, 5),
        # Choice 0 had ended: only choice 1 is cut.
        ([choice_frame(0, "abc", 3), choice_frame(0, "", 3, "length"), choice_frame(1, "xy", 2)],
         False, {0: "length", 1: None}, 5),
        # The router lost the engine: its error (naming no choice) ends every open choice.
        ([choice_frame(0, "abc", 3), choice_frame(1, "xy", 2), LOST_FOR_ALL,
          b"data: [DONE]\n\n"], True, {0: None, 1: None}, 5),
        # The engine failed choice 1 alone: choice 0 goes on to its end.
        ([choice_frame(0, "a", 1), choice_frame(1, "xy", 2),
          b'data: {"error": {"message": "boom"}, "atrium_choice_usage": {"index": 1,'
          b' "completion_tokens": 2, "cached_tokens": 3}}\n\n',
          choice_frame(0, "bc", 3), choice_frame(0, "", 3, "length"), b"data: [DONE]\n\n"],
         True, {0: "length", 1: None}, 5),
    ],
)  # fmt: skip
def test_each_choice_of_a_stream_ends_on_its_own_and_is_billed_what_it_delivered(
    tiny_llama_dir: Path,
    frames: list[bytes],
    clean: bool,
    finishes: dict[int, str | None],
    billed: int,
) -> None:
    handler: Handler = lambda request: httpx.Response(200, stream=CutStream(frames, clean))  # noqa: E731
    with gateway(tiny_llama_dir, handler) as client:
        body = {"model": MODEL, "prompt": "hello world", "max_tokens": 5, "n": 2,
                "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
        answer = client.post("/v1/completions", json=body, headers=AUTH)
        records = tenancy_of(client).usage
    chunks = payloads(answer)
    assert texts_by_choice(chunks) == {0: "abc", 1: "xy"}
    ends = {c["choices"][0]["index"]: c["choices"][0]["finish_reason"]
            for c in chunks if c.get("choices") and c["choices"][0]["finish_reason"]}  # fmt: skip
    assert {index: ends.get(index) for index in (0, 1)} == finishes
    errors = [c["error"]["message"] for c in chunks if "error" in c]
    assert errors == [LOST] * sum(reason is None for reason in finishes.values())
    assert chunks[-1]["usage"]["completion_tokens"] == billed
    assert [(r.status, r.completion_tokens) for r in records] == [("error", billed)]


def test_a_stream_of_several_choices_without_their_counts_is_refused_unbilled(
    tiny_llama_dir: Path,
) -> None:
    frames = [frame("a", 1), frame("b", 2, "length"), b"data: [DONE]\n\n"]  # n=1's shape
    handler: Handler = lambda request: httpx.Response(200, stream=CutStream(frames, clean=True))  # noqa: E731
    with gateway(tiny_llama_dir, handler) as client:
        body = {"model": MODEL, "prompt": "hello world", "max_tokens": 5, "n": 2}
        answer = client.post("/v1/completions", json=body, headers=AUTH)
        records = tenancy_of(client).usage
    assert answer.status_code == 503
    assert [(r.status, r.completion_tokens) for r in records] == [("unavailable", 0)]


def test_an_engine_that_takes_no_n_gets_each_choice_alone(tiny_llama_dir: Path) -> None:
    """During a rolling upgrade an engine of the previous release refuses ``n``: the gateway
    then sends the choices one request each, as that release did, and answers as ever."""
    message = "`n` is not supported by the engine API."
    refused = {"error": {"message": message, "param": "n", "code": "unsupported_parameter"}}

    def old_engine(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if body.get("n", 1) != 1:
            return httpx.Response(400, json=refused)
        word = "a" if body["atrium_sampling"]["seed"] == 4 else "x"
        frames = [frame(word, 1), frame(word, 2, "length"), b"data: [DONE]\n\n"]
        return httpx.Response(200, stream=CutStream(frames, clean=True))

    _, sent, records, choices = two_seeded_choices(tiny_llama_dir, old_engine)
    assert choices == [(0, "aa", "length"), (1, "xx", "length")]
    assert [one.get("n", 1) for one in sent] == [2, 1, 1]
    assert [one["atrium_sampling"]["seed"] for one in sent[1:]] == [4, 5]
    assert [(r.status, r.completion_tokens) for r in records] == [("ok", 4)]
