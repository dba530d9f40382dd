"""The realistic chat workload: real text, the mix it promises, follow-ups that carry answers."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from bench.chat_workload import (
    Conversation,
    chat_body,
    conversations,
    passages,
    run_conversations,
    run_open_loop,
)
from bench.loadgen import Target


def test_passages_are_real_paragraphs_within_bounds() -> None:
    pool = passages(min_words=60, max_words=400)
    assert len(pool) > 150
    assert pool == passages(min_words=60, max_words=400)  # the same corpus every time
    for text in pool:
        assert 60 <= len(text.split()) <= 400
    assert sum("the" in text.split() for text in pool) > 0.9 * len(pool)  # English prose


def test_conversations_mix_sampling_and_follow_ups_on_distinct_passages() -> None:
    items = conversations(num_tenants=4, num_conversations=120, seed=3, max_tokens=64)
    assert {c.tenant for c in items} == {"t0", "t1", "t2", "t3"}
    first_turns = [c.turns[0] for c in items]
    assert len(set(first_turns)) == len(items)
    assert 0.35 < sum(c.temperature > 0 for c in items) / len(items) < 0.65
    assert 0.2 < sum(len(c.turns) == 2 for c in items) / len(items) < 0.45
    # Each tenant's conversations share its system prompt; tenants' prompts differ.
    systems = {c.tenant: c.system for c in items}
    assert all(c.system == systems[c.tenant] for c in items)
    assert len(set(systems.values())) == 4
    assert conversations(4, 120, seed=3, max_tokens=64) == items
    assert conversations(4, 120, seed=4, max_tokens=64) != items


def test_a_follow_up_carries_the_first_answer_and_nothing_ignores_eos() -> None:
    target = Target("http://127.0.0.1:1", "m", {}, {"ignore_eos": True})
    item = next(c for c in conversations(2, 40, seed=1) if len(c.turns) == 2)
    body = chat_body(target, item, ["the first answer"], 1)
    roles = [m["role"] for m in body["messages"]]
    assert roles == ["system", "user", "assistant", "user"]
    assert body["messages"][2]["content"] == "the first answer"
    assert body["messages"][3]["content"] == item.turns[1]
    assert "ignore_eos" not in body and body["stream"] is True


def mock_chat(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Answer every chat completion with one chunk naming its message count; returns the bodies
    as they arrive."""
    seen: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append(body)
        assert request.url.path == "/v1/chat/completions"
        answer = f"answer {len(body['messages'])}"
        events = [
            {"choices": [{"delta": {"content": answer}}]},
            {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 1}},
        ]
        text = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        return httpx.Response(200, text=text, headers={"content-type": "text/event-stream"})

    real_client = httpx.AsyncClient

    def client(*args: object, **kwargs: object) -> httpx.AsyncClient:
        return real_client(transport=httpx.MockTransport(handler))

    monkeypatch.setattr("bench.loadgen.httpx.AsyncClient", client)
    return seen


def check_follow_ups(seen: list[dict[str, Any]], items: list[Conversation]) -> None:
    follow_ups = [b for b in seen if len(b["messages"]) == 4]
    assert len(follow_ups) == sum(len(c.turns) == 2 for c in items)
    for body in follow_ups:
        assert body["messages"][2] == {"role": "assistant", "content": "answer 2"}


def test_conversations_run_turn_after_turn_over_chat_completions(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen = mock_chat(monkeypatch)
    items = conversations(2, 12, seed=5)
    target = Target("http://127.0.0.1:9", "m")

    records = asyncio.run(run_conversations(target, items, concurrency=3))
    assert len(records) == sum(len(c.turns) for c in items)
    assert all(r.ok and r.completion_tokens == 1 for r in records)
    check_follow_ups(seen, items)


def test_an_open_loop_starts_each_conversation_at_its_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen = mock_chat(monkeypatch)
    items = conversations(2, 8, seed=6)
    offsets = [0.02 * i for i in range(len(items))]
    target = Target("http://127.0.0.1:9", "m")

    records = asyncio.run(run_open_loop(target, items, offsets, deadline_s=30.0))
    assert len(records) == sum(len(c.turns) for c in items)
    assert all(r.ok for r in records)
    check_follow_ups(seen, items)
    # Records come in the schedule's order, a conversation's turns together; each
    # conversation's first turn leaves at its offset.
    firsts, i = [], 0
    for item in items:
        firsts.append(records[i].sent_at)
        i += len(item.turns)
    for at, offset in zip(firsts, offsets, strict=True):
        assert at - firsts[0] == pytest.approx(offset, abs=0.04)
