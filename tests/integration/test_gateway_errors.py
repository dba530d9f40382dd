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

from tests.integration.gateway_fakes import KEY_A, MODEL, make_runtime, make_tenancy
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
