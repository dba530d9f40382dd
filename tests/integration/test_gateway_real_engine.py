"""The gateway over the real engine on the tiny model: answers, streams and cache accounting."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from litestar.testing import TestClient

from tests.integration.gateway_fakes import KEY_A, make_tenancy, settings
from web.app import create_app
from web.tenancy.principal import InMemoryTenancy

AUTH = {"Authorization": f"Bearer {KEY_A}"}


@pytest.fixture(scope="module")
def gateway(tiny_llama_dir: Path) -> Iterator[tuple[TestClient, InMemoryTenancy, str]]:  # type: ignore[type-arg]
    tenancy = make_tenancy()
    config = settings(
        model=str(tiny_llama_dir), dtype="float32", device="cpu", kv_cache_bytes=8 * 2**20
    )
    app = create_app(config, store=tenancy, include_admin=False)
    with TestClient(app) as client:
        model = client.get("/v1/models", headers=AUTH).json()["data"][0]["id"]
        yield client, tenancy, model


def test_streamed_text_equals_non_streamed(
    gateway: tuple[TestClient, InMemoryTenancy, str],  # type: ignore[type-arg]
) -> None:
    client, tenancy, model = gateway
    body = {"model": model, "prompt": "hello world", "max_tokens": 12, "seed": 5,
            "temperature": 0.9}  # fmt: skip
    whole = client.post("/v1/completions", json=body, headers=AUTH)
    assert whole.status_code == 200, whole.text
    streamed = client.post(
        "/v1/completions",
        json={**body, "stream": True, "stream_options": {"include_usage": True}},
        headers=AUTH,
    )
    frames = [f.removeprefix("data: ") for f in streamed.text.split("\n\n") if f]
    assert frames[-1] == "[DONE]"
    chunks = [json.loads(f) for f in frames[:-1]]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == whole.json()["choices"][0]["text"]
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] == whole.json()["usage"]["completion_tokens"]
    assert {u.status for u in tenancy.usage} == {"ok"}


def test_repeated_long_prompt_reports_cached_tokens(
    gateway: tuple[TestClient, InMemoryTenancy, str],  # type: ignore[type-arg]
) -> None:
    client, _, model = gateway
    messages = [{"role": "user", "content": "a fairly long shared prefix " * 4}]
    body = {"model": model, "messages": messages, "max_tokens": 2}
    first = client.post("/v1/chat/completions", json=body, headers=AUTH).json()
    again = client.post("/v1/chat/completions", json=body, headers=AUTH).json()
    assert first["usage"]["prompt_tokens"] == again["usage"]["prompt_tokens"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    metrics = client.get("/metrics").text
    assert "atrium_kv_pages_total" in metrics
