"""Every bad input gets a 4xx in OpenAI's error shape, never a 500."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from litestar.testing import TestClient
from structlog.testing import capture_logs

from tests.integration.gateway_fakes import KEY_A, KEY_B, MODEL, make_runtime, make_tenancy
from tests.integration.gateway_fakes import settings as gateway_settings
from web.app import create_app

AUTH = {"Authorization": f"Bearer {KEY_A}"}
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def client(tiny_llama_dir: Path) -> Iterator[TestClient]:  # type: ignore[type-arg]
    runtime, _ = make_runtime(tiny_llama_dir)
    app = create_app(
        gateway_settings(max_body_bytes=4096),
        engine=runtime,
        store=make_tenancy(),
        include_admin=False,
    )
    with TestClient(app) as test_client:
        yield test_client


def assert_error(response: Any, status: int, param: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if param is not None:
        assert error["param"] == param
    return dict(error)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": MODEL}, "messages"),
        ({"model": MODEL, "messages": []}, "messages"),
        ({"model": MODEL, "messages": "hi"}, "messages"),
        ({"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"model": MODEL, "messages": USER, "max_tokens": 0}, "max_tokens"),
        ({"model": MODEL, "messages": USER, "max_tokens": -3}, "max_tokens"),
        ({"model": MODEL, "messages": USER, "max_tokens": 10**9}, "max_tokens"),
        ({"model": MODEL, "messages": USER, "max_completion_tokens": 0}, "max_completion_tokens"),
        ({"model": MODEL, "messages": USER, "temperature": 3}, "temperature"),
        ({"model": MODEL, "messages": USER, "top_p": 1.5}, "top_p"),
        ({"model": MODEL, "messages": USER, "n": 0}, "n"),
        ({"model": MODEL, "messages": USER, "stop": [""]}, "stop"),
        ({"model": MODEL, "messages": USER, "seed": "x"}, "seed"),
    ],
)
def test_bad_chat_requests_are_400(
    client: TestClient,  # type: ignore[type-arg]
    body: dict[str, Any],
    param: str,
) -> None:
    assert_error(client.post("/v1/chat/completions", json=body, headers=AUTH), 400, param)


def test_unknown_model_is_404(client: TestClient) -> None:  # type: ignore[type-arg]
    body = {"model": "gpt-17", "messages": USER}
    error = assert_error(client.post("/v1/chat/completions", json=body, headers=AUTH), 404)
    assert error["code"] == "model_not_found"


def test_prompt_over_the_model_context_is_400(client: TestClient) -> None:  # type: ignore[type-arg]
    body = {"model": MODEL, "prompt": "y" * 300}
    response = client.post("/v1/completions", json=body, headers=AUTH)
    assert assert_error(response, 400, "prompt")["code"] == "context_length_exceeded"


def test_malformed_json_is_400(client: TestClient) -> None:  # type: ignore[type-arg]
    response = client.post(
        "/v1/chat/completions",
        content=b'{"model": "x", "messages": [',
        headers={**AUTH, "content-type": "application/json"},
    )
    assert assert_error(response, 400)["code"] == "invalid_json"


def test_body_over_the_limit_is_413(client: TestClient) -> None:  # type: ignore[type-arg]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "z" * 5000}]}
    assert_error(client.post("/v1/chat/completions", json=body, headers=AUTH), 413)


def test_unknown_route_and_wrong_method(client: TestClient) -> None:  # type: ignore[type-arg]
    assert_error(client.get("/v1/nothing", headers=AUTH), 404)
    assert_error(client.get("/v1/chat/completions", headers=AUTH), 405)


def test_auth_is_checked_before_the_body(client: TestClient) -> None:  # type: ignore[type-arg]
    response = client.post("/v1/chat/completions", content=b"{", headers={"Authorization": "x"})
    assert assert_error(response, 401)["type"] == "authentication_error"


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=8,
)
fields = st.sampled_from(
    ["model", "messages", "max_tokens", "temperature", "top_p", "stop", "n", "stream", "seed",
     "stream_options", "prompt", "top_k", "max_completion_tokens"]
)  # fmt: skip
bodies = st.dictionaries(fields, json_values, max_size=6) | json_values


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(body=bodies, path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]))
def test_random_bodies_never_give_a_server_error(
    client: TestClient,  # type: ignore[type-arg]
    body: Any,
    path: str,
) -> None:
    if isinstance(body, dict) and "max_tokens" in body:
        body["max_tokens"] = 2 if body["max_tokens"] is None else body["max_tokens"]
    response = client.post(path, content=json.dumps(body).encode(), headers=AUTH)
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        assert_error(response, response.status_code)


def test_a_request_before_start_up_is_a_503_not_a_500(tiny_llama_dir: Path) -> None:
    # Without the lifespan (the engines not started yet) the routes' generation service does
    # not exist: the answer says so and asks to retry, it is never a 500.
    runtime, _ = make_runtime(tiny_llama_dir)
    app = create_app(gateway_settings(), engine=runtime, store=make_tenancy())

    async def post() -> Any:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw.local") as client:
            return await client.post(
                "/v1/chat/completions",
                json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
                headers={"Authorization": f"Bearer {KEY_A}"},
            )

    response = asyncio.run(post())
    assert response.status_code == 503, response.text
    assert response.json()["error"]["code"] == "starting"
    assert response.headers["retry-after"] == "1"


def test_every_response_carries_a_request_id(client: TestClient) -> None:  # type: ignore[type-arg]
    chat = {"model": MODEL, "messages": USER, "max_tokens": 2}
    responses = {
        "answer": client.post("/v1/chat/completions", json=chat, headers=AUTH),
        "quota": client.post(
            "/v1/chat/completions", json=chat, headers={"Authorization": f"Bearer {KEY_B}"}
        ),
        "no key": client.post("/v1/chat/completions", json=chat),
        "bad body": client.post("/v1/completions", json={"model": MODEL}, headers=AUTH),
        "unknown route": client.get("/v1/nothing", headers=AUTH),
        "wrong method": client.get("/v1/chat/completions", headers=AUTH),
        "models": client.get("/v1/models", headers=AUTH),
        "metrics": client.get("/metrics"),
    }
    assert [r.status_code for r in responses.values()] == [200, 429, 401, 400, 404, 405, 200, 200]
    ids = {name: r.headers["x-request-id"] for name, r in responses.items()}
    assert len(set(ids.values())) == len(ids)  # one of its own each
    # A generation request is named by its completion id, answered or refused.
    assert ids["answer"] == responses["answer"].json()["id"]
    assert ids["quota"].startswith("chatcmpl-") and ids["bad body"].startswith("cmpl-")
    assert ids["unknown route"].startswith("req-")


@pytest.mark.parametrize("sent", ["trace-7f3a.42:span/1", "0b1c3f2e-9d4a-4f7e-8a61-7d2f1c9e0a55"])
def test_a_sane_client_request_id_is_kept(client: TestClient, sent: str) -> None:  # type: ignore[type-arg]
    chat = {"model": MODEL, "messages": USER, "max_tokens": 2}
    answered = client.post(
        "/v1/chat/completions", json=chat, headers={**AUTH, "x-request-id": sent}
    )
    assert answered.status_code == 200
    assert answered.headers["x-request-id"] == sent
    assert answered.json()["id"].startswith("chatcmpl-")  # the completion keeps its own id
    refused = client.post(
        "/v1/chat/completions",
        json=chat,
        headers={"Authorization": f"Bearer {KEY_B}", "x-request-id": sent},
    )
    assert (refused.status_code, refused.headers["x-request-id"]) == (429, sent)


@pytest.mark.parametrize("sent", ["", "two words", "x" * 129, "tab\there", "semi;colon", "é"])
def test_an_odd_client_request_id_is_replaced(client: TestClient, sent: str) -> None:  # type: ignore[type-arg]
    chat = {"model": MODEL, "messages": USER, "max_tokens": 2}
    response = client.post(
        "/v1/chat/completions",
        json=chat,
        headers={**AUTH, "x-request-id": sent.encode()},  # type: ignore[dict-item]
    )
    assert response.status_code == 200
    assert response.headers["x-request-id"] == response.json()["id"] != sent


def test_one_log_line_per_request_refusals_included(client: TestClient) -> None:  # type: ignore[type-arg]
    chat = {"model": MODEL, "messages": USER, "max_tokens": 3}
    b_auth = {"Authorization": f"Bearer {KEY_B}"}
    with capture_logs() as logs:
        responses = [
            client.post("/v1/chat/completions", json=chat, headers=AUTH),
            client.post("/v1/chat/completions", json={**chat, "stream": True}, headers=AUTH),
            client.post("/v1/chat/completions", json=chat, headers=b_auth),
            client.post("/v1/chat/completions", json=chat, headers={"Authorization": "Bearer x"}),
            client.post("/v1/chat/completions", json={**chat, "max_tokens": 0}, headers=AUTH),
        ]
    assert [r.status_code for r in responses] == [200, 200, 429, 401, 400]
    lines = [entry for entry in logs if entry["event"] == "request_done"]
    assert [line["request_id"] for line in lines] == [r.headers["x-request-id"] for r in responses]
    assert not [entry for entry in logs if entry["event"] == "request_finished"]
    for line in lines:
        assert {"status", "model", "key_id", "tenant_id", "prompt_tokens", "completion_tokens",
                "cached_tokens", "ttft_s", "duration_s", "reason"} <= set(line)  # fmt: skip
        assert line["log_level"] == "info" and line["duration_s"] >= 0
    answered, streamed, quota, no_key, bad = lines
    for line in (answered, streamed):
        assert (line["status"], line["outcome"], line["reason"]) == (200, "ok", None)
        assert (line["tenant_id"], line["key_id"], line["model"]) == (
            "tenant-a",
            "key-tenant-a",
            MODEL,
        )
        assert line["prompt_tokens"] > 0 and line["completion_tokens"] == 3
        assert 0 < line["ttft_s"] <= line["duration_s"]
    assert (quota["status"], quota["outcome"], quota["reason"]) == (429, "refused", "concurrency")
    assert (quota["tenant_id"], quota["model"], quota["completion_tokens"]) == (
        "tenant-b",
        MODEL,
        0,
    )
    assert quota["ttft_s"] is None
    assert (no_key["status"], no_key["reason"], no_key["tenant_id"]) == (
        401,
        "invalid_api_key",
        None,
    )
    assert (bad["status"], bad["reason"], bad["tenant_id"]) == (400, "invalid_request", "tenant-a")
