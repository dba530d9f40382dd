"""A response past ``max_stream_s`` ends as "length" with what it delivered, metered once, and
its engine request aborted: so a drain as long as the limit lets every stream finish."""

from __future__ import annotations

import json
from pathlib import Path

from litestar.testing import TestClient

from tests.integration.gateway_fakes import KEY_A, MODEL, make_runtime, make_tenancy, settings
from web.app import create_app


def test_a_stream_past_the_limit_ends_as_length_and_is_metered(tiny_llama_dir: Path) -> None:
    runtime, engine = make_runtime(tiny_llama_dir, delay_s=0.02)  # 50 tokens a second
    tenancy = make_tenancy()
    app = create_app(settings(max_stream_s=0.3), engine=runtime, store=tenancy, include_admin=False)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 200,
            "stream": True}  # fmt: skip
    with TestClient(app) as client:
        response = client.post(
            "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY_A}"}
        )
    assert response.status_code == 200
    events = [line.removeprefix("data: ") for line in response.text.splitlines() if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    reasons = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert reasons[-1] == "length" and reasons.count("length") == 1
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    (usage,) = tenancy.usage
    assert usage.status == "ok" and 5 <= usage.completion_tokens < 200
    assert len(text) == usage.completion_tokens  # one letter a token: what was sent is billed
    assert engine.aborted == [usage.request_id]


def test_the_default_limit_is_ten_minutes() -> None:
    assert settings().max_stream_s == 600.0
