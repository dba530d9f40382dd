"""The OpenAI routes over the test client: shapes, streaming framing, usage and metering."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from litestar.testing import TestClient

from tests.integration.gateway_fakes import (
    KEY_A,
    KEY_B,
    KEY_SUSPENDED,
    MODEL,
    ScriptedEngine,
    make_runtime,
    make_tenancy,
    settings,
)
from web.app import create_app
from web.openai.generation import ModelRuntime
from web.tenancy.principal import InMemoryTenancy

AUTH = {"Authorization": f"Bearer {KEY_A}"}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hello there"}]}


@pytest.fixture
def parts(tiny_llama_dir: Path) -> tuple[ScriptedEngine, InMemoryTenancy]:
    _, engine = make_runtime(tiny_llama_dir)
    return engine, make_tenancy()


@pytest.fixture
def client(parts: tuple[ScriptedEngine, InMemoryTenancy]) -> Iterator[TestClient]:  # type: ignore[type-arg]
    engine, tenancy = parts
    runtime = ModelRuntime(MODEL, engine, engine.tokenizer, max_model_len=256)
    app = create_app(settings(), engine=runtime, store=tenancy, include_admin=False)
    with TestClient(app) as test_client:
        yield test_client


def sse_payloads(body: str) -> list[str]:
    frames = [f for f in body.split("\n\n") if f]
    assert all(f.startswith("data: ") for f in frames), frames
    return [f.removeprefix("data: ") for f in frames]


def test_models_lists_the_served_model(client: TestClient) -> None:  # type: ignore[type-arg]
    response = client.get("/v1/models", headers=AUTH)
    assert response.status_code == 200
    assert response.json()["data"][0]["id"] == MODEL
    assert response.json()["object"] == "list"


def test_chat_completion_shape_and_usage(
    client: TestClient,  # type: ignore[type-arg]
    parts: tuple[ScriptedEngine, InMemoryTenancy],
) -> None:
    response = client.post(
        "/v1/chat/completions", json={**CHAT, "max_tokens": 5, "seed": 3}, headers=AUTH
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert len(body["choices"][0]["message"]["content"]) == 5
    assert body["choices"][0]["finish_reason"] == "length"
    usage = body["usage"]
    assert usage["completion_tokens"] == 5
    assert usage["total_tokens"] == usage["prompt_tokens"] + 5
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0}
    engine, tenancy = parts
    assert engine.requests[0].tenant_id == "tenant-a"
    assert [u.request_id for u in tenancy.usage] == [body["id"]]
    assert tenancy.usage[0].status == "ok"
    assert tenancy.usage[0].completion_tokens == 5
    assert response.headers["x-request-id"] == body["id"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_one_token_answer_is_metered_ok_before_the_response_ends(
    client: TestClient,  # type: ignore[type-arg]
    parts: tuple[ScriptedEngine, InMemoryTenancy],
    stream: bool,
) -> None:
    # The first output already finishes the request: its usage is written as a finished answer
    # by the time the client has the response, not later as a disconnect.
    response = client.post(
        "/v1/chat/completions", json={**CHAT, "max_tokens": 1, "stream": stream}, headers=AUTH
    )
    assert response.status_code == 200, response.text
    _, tenancy = parts
    assert [(u.status, u.completion_tokens) for u in tenancy.usage] == [("ok", 1)]


def test_default_max_tokens_is_remaining_context_capped(
    client: TestClient,  # type: ignore[type-arg]
    parts: tuple[ScriptedEngine, InMemoryTenancy],
) -> None:
    response = client.post("/v1/chat/completions", json=CHAT, headers=AUTH)
    assert response.status_code == 200
    request = parts[0].requests[0]
    assert request.params.max_tokens == 256 - len(request.prompt_token_ids)


def test_stop_string_cuts_the_text(client: TestClient) -> None:  # type: ignore[type-arg]
    plain = client.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": "abc", "max_tokens": 8, "seed": 1},
        headers=AUTH,
    ).json()
    text = plain["choices"][0]["text"]
    stop = text[3]
    cut = client.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": "abc", "max_tokens": 8, "seed": 1, "stop": [stop]},
        headers=AUTH,
    ).json()
    assert cut["choices"][0]["text"] == text[: text.index(stop)]
    assert cut["choices"][0]["finish_reason"] == "stop"
    assert plain["object"] == "text_completion"


def test_streamed_chat_equals_non_streamed(client: TestClient) -> None:  # type: ignore[type-arg]
    request = {**CHAT, "max_tokens": 6, "seed": 11, "temperature": 0.8}
    whole = client.post("/v1/chat/completions", json=request, headers=AUTH).json()
    streamed = client.post(
        "/v1/chat/completions",
        json={**request, "stream": True, "stream_options": {"include_usage": True}},
        headers=AUTH,
    )
    assert streamed.status_code == 200
    assert streamed.headers["content-type"].startswith("text/event-stream")
    payloads = sse_payloads(streamed.text)
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == whole["choices"][0]["message"]["content"]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 6
    assert chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # repeated prompt


def test_streamed_completion_without_usage(client: TestClient) -> None:  # type: ignore[type-arg]
    response = client.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": "abc", "max_tokens": 3, "stream": True},
        headers=AUTH,
    )
    payloads = sse_payloads(response.text)
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert payloads[-1] == "[DONE]"
    assert all(c["choices"] for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert "".join(c["choices"][0]["text"] for c in chunks) != ""


@pytest.mark.parametrize(
    ("key", "status", "code"),
    [
        (None, 401, "invalid_api_key"),
        ("sk-unknown", 401, "invalid_api_key"),
        (KEY_SUSPENDED, 403, "tenant_suspended"),
    ],
)
def test_auth_failures(
    client: TestClient,  # type: ignore[type-arg]
    key: str | None,
    status: int,
    code: str,
) -> None:
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    response = client.post("/v1/chat/completions", json=CHAT, headers=headers)
    assert response.status_code == status
    assert response.json()["error"]["code"] == code


def test_quota_refusal_is_429_with_retry_headers(
    client: TestClient,  # type: ignore[type-arg]
    parts: tuple[ScriptedEngine, InMemoryTenancy],
) -> None:
    headers = {"Authorization": f"Bearer {KEY_B}"}
    response = client.post("/v1/chat/completions", json=CHAT, headers=headers)
    assert response.status_code == 429
    assert response.json()["error"]["type"] == "rate_limit_error"
    assert response.headers["retry-after"] == "2"
    assert response.headers["retry-after-ms"] == "1500"
    assert response.headers["x-ratelimit-remaining-requests"] == "0"
    assert parts[0].requests == []  # nothing reached the engine


def test_tenant_prompt_limit_is_413(client: TestClient) -> None:  # type: ignore[type-arg]
    long_prompt = {"model": MODEL, "prompt": "x" * 220, "max_tokens": 4}
    response = client.post("/v1/completions", json=long_prompt, headers=AUTH)
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "prompt_too_large"


def test_metrics_count_tokens_per_tenant(client: TestClient) -> None:  # type: ignore[type-arg]
    client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 4}, headers=AUTH)
    text = client.get("/metrics").text
    assert "atrium_completion_tokens_total 4.0" in text  # totals: no tenant label by default
    assert "vllm:time_to_first_token_seconds_bucket" in text
    assert client.get("/healthz").json() == {"status": "ok"}
    assert client.get("/readyz").status_code == 200


def test_responses_decode_as_openai_models(client: TestClient) -> None:  # type: ignore[type-arg]
    from openai.types.chat import ChatCompletion

    body = client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2}, headers=AUTH)
    parsed = ChatCompletion.model_validate(body.json())
    assert parsed.usage is not None
    assert parsed.usage.prompt_tokens_details is not None
    assert parsed.usage.prompt_tokens_details.cached_tokens == 0
    assert msgspec.json.decode(body.content)["model"] == MODEL
