"""Cached prompt tokens are billed at a discount, so they are reported exactly: what the
tenant's own namespace of the prefix cache holds for the prompt, never more, never another's."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from litestar.testing import TestClient

from engine.outputs import GenerateRequest
from radix_cache.prefix_cache import tenant_namespace
from tests.integration.gateway_fakes import KEY_A, make_tenancy, settings
from web.app import create_app
from web.tenancy.principal import InMemoryTenancy, InMemoryTenant

KEY_C = "sk-tenant-c"


@pytest.fixture
def gateway(tiny_llama_dir: Path) -> Iterator[tuple[Any, InMemoryTenancy, Any, list[list[int]]]]:
    tenancy = make_tenancy()
    tenancy.add_key(KEY_C, InMemoryTenant("tenant-c"))
    config = settings(
        model=str(tiny_llama_dir),
        dtype="float32",
        device="cpu",
        kv_cache_bytes=8 * 2**20,
        engine_process=False,  # the cache is inspected in-process
    )
    app = create_app(config, store=tenancy, include_admin=False)
    with TestClient(app) as client:
        llm = app.state.engine._engine
        prompts: list[list[int]] = []
        add = llm.add_request

        def spy(request: GenerateRequest) -> None:
            prompts.append(list(request.prompt_token_ids))
            add(request)

        llm.add_request = spy
        yield client, tenancy, llm, prompts


def _chat(client: Any, key: str, content: str) -> dict[str, Any]:
    model = client.get("/v1/models", headers={"Authorization": f"Bearer {key}"}).json()
    body = {
        "model": model["data"][0]["id"],
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 3,
    }
    response = client.post(
        "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
    )
    assert response.status_code == 200, response.text
    return dict(response.json()["usage"])


@pytest.mark.parametrize("words", [7, 23])
def test_cached_tokens_equal_the_tenants_cached_prefix_exactly(
    gateway: tuple[Any, InMemoryTenancy, Any, list[list[int]]], words: int
) -> None:
    client, tenancy, llm, prompts = gateway
    content = " ".join(f"word{i}" for i in range(words))
    first = _chat(client, KEY_A, content)
    assert first["prompt_tokens_details"]["cached_tokens"] == 0  # nothing was cached yet
    ids = prompts[-1]
    assert len(ids) == first["prompt_tokens"]
    page = llm.cache.page_size
    # What the cache holds for this prompt in tenant a's namespace, before the repeat (the
    # last prompt token is always computed, so at most the full pages before it count).
    held = llm.cache.match(tenant_namespace("tenant-a"), ids[:-1], False).num_tokens
    assert held == (len(ids) - 1) // page * page > 0

    again = _chat(client, KEY_A, content)
    assert again["prompt_tokens"] == first["prompt_tokens"]
    assert again["prompt_tokens_details"]["cached_tokens"] == held

    # Another tenant's identical prompt reuses nothing of tenant a's.
    other = _chat(client, KEY_C, content)
    assert other["prompt_tokens_details"]["cached_tokens"] == 0

    # The usage events (what billing prices) carry the very same counts.
    assert [(u.tenant_id, u.prompt_tokens, u.cached_tokens) for u in tenancy.usage[-3:]] == [
        ("tenant-a", len(ids), 0),
        ("tenant-a", len(ids), held),
        ("tenant-c", len(ids), 0),
    ]
