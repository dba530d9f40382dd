"""A real `atrium serve` with the default model, driven by the official openai client."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.support.serve import Server, running_server

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running_server(tmp_path_factory.mktemp("serve")) as (srv, proc, log_path):
        yield srv
        proc.terminate()
        assert proc.wait(timeout=60) == 0, log_path.read_text()


def test_chat_and_completions(server: Server) -> None:
    client = server.client(server.key_for("acme"))
    model = client.models.list().data[0].id
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say hi"}], max_tokens=8, seed=1
    )
    assert chat.choices[0].message.content
    assert chat.usage is not None and chat.usage.completion_tokens <= 8
    text = client.completions.create(model=model, prompt="Once upon a time", max_tokens=5)
    assert text.choices[0].text and text.usage is not None


def test_stream_with_usage_equals_non_streamed(server: Server) -> None:
    client = server.client(server.key_for("acme"))
    model = client.models.list().data[0].id
    args = {"model": model, "messages": [{"role": "user", "content": "Count to five"}],
            "max_tokens": 16, "seed": 7, "temperature": 0.7}  # fmt: skip
    whole = client.chat.completions.create(**args)  # type: ignore[call-overload]
    chunks = list(
        client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True})  # type: ignore[call-overload]
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_cached_tokens_are_per_tenant(server: Server) -> None:
    prompt = "You are a careful assistant. " * 40 + "Answer briefly."
    messages = [{"role": "user", "content": prompt}]
    first = server.client(server.key_for("cache-a"))
    model = first.models.list().data[0].id
    first.chat.completions.create(model=model, messages=messages, max_tokens=1)  # type: ignore[arg-type]
    again = first.chat.completions.create(model=model, messages=messages, max_tokens=1)  # type: ignore[arg-type]
    other = server.client(server.key_for("cache-b")).chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=1,  # type: ignore[arg-type]
    )
    assert again.usage and again.usage.prompt_tokens_details
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert other.usage and other.usage.prompt_tokens_details
    assert other.usage.prompt_tokens_details.cached_tokens == 0


def test_auth_errors(server: Server) -> None:
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.AuthenticationError):
        server.client("sk-not-a-key").chat.completions.create(
            model="default",
            messages=messages,
            max_tokens=1,  # type: ignore[arg-type]
        )
    key = server.key_for("revoked")
    keys = server.admin("GET", f"/admin/v1/tenants/{server.tenant_ids['revoked']}/keys").json()
    for entry in keys if isinstance(keys, list) else keys.get("data", []):
        server.admin("DELETE", f"/admin/v1/keys/{entry['id']}")
    with pytest.raises(openai.AuthenticationError):
        server.client(key).chat.completions.create(
            model="default",
            messages=messages,
            max_tokens=1,  # type: ignore[arg-type]
        )
    key = server.key_for("sleepy")
    server.admin(
        "PATCH", f"/admin/v1/tenants/{server.tenant_ids['sleepy']}", {"status": "suspended"}
    )
    with pytest.raises(openai.PermissionDeniedError):
        server.client(key).chat.completions.create(
            model="default",
            messages=messages,
            max_tokens=1,  # type: ignore[arg-type]
        )


def test_rate_limit_and_bad_requests(server: Server) -> None:
    key = server.key_for("limited")
    quotas = {"quotas": {"requests_per_minute": 1}}
    patched = server.admin("PATCH", f"/admin/v1/tenants/{server.tenant_ids['limited']}", quotas)
    assert patched.status_code == 200, patched.text
    client = server.client(key)
    messages = [{"role": "user", "content": "hi"}]
    client.chat.completions.create(model="default", messages=messages, max_tokens=1)  # type: ignore[arg-type]
    with pytest.raises(openai.RateLimitError) as info:
        client.chat.completions.create(model="default", messages=messages, max_tokens=1)  # type: ignore[arg-type]
    assert int(info.value.response.headers["retry-after"]) >= 1
    other = server.client(server.key_for("acme"))
    with pytest.raises(openai.BadRequestError):
        other.chat.completions.create(model="default", messages=[], max_tokens=1)
    with pytest.raises(openai.BadRequestError):
        other.chat.completions.create(model="default", messages=messages, temperature=7)  # type: ignore[arg-type]
    with pytest.raises(openai.NotFoundError):
        other.chat.completions.create(model="nope", messages=messages)  # type: ignore[arg-type]


def test_logprobs_n_and_refusals_on_the_default_model(server: Server) -> None:
    key = server.key_for("acme")
    client = server.client(key)
    messages: Any = [{"role": "user", "content": "Name a colour."}]
    args: Any = {"model": "default", "messages": messages, "max_tokens": 8, "temperature": 0}
    answer = client.chat.completions.create(**args, n=2, logprobs=True, top_logprobs=2)
    first, second = answer.choices
    assert (first.index, second.index) == (0, 1)
    assert first.message.content == second.message.content  # greedy twins
    entries = first.logprobs.content  # type: ignore[union-attr]
    assert len(entries) * 2 == answer.usage.completion_tokens  # type: ignore[union-attr]
    assert "".join(e.token for e in entries).startswith(first.message.content or "")
    assert all(e.token == e.top_logprobs[0].token for e in entries)
    chunks = list(client.chat.completions.create(**args, logprobs=True, stream=True))
    streamed = [e.token for c in chunks if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content or []]  # fmt: skip
    assert streamed == [e.token for e in entries]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**args, extra_body={"best_of": 2})
    assert info.value.body["param"] == "best_of"  # type: ignore[index]
    auth = {"Authorization": f"Bearer {key}"}
    ids = httpx.post(f"{server.base}/tokenize", json={"messages": messages}, headers=auth).json()
    assert ids["count"] == answer.usage.prompt_tokens  # type: ignore[union-attr]
    assert client.models.retrieve("default").id == "default"
