"""Chat traffic that looks like users': real English text, the chat template, mixed sampling.

The text is Python's own reference documentation as installed with it (``pydoc_data.topics``,
under the PSF license), cut into passages at paragraph breaks. Each tenant has a system prompt
(its instructions and a passage of its own, shared by all its conversations); each conversation
asks about a fresh passage, half of them greedy and half sampled at temperature 0.7, and a third
of them follow up with a second turn that carries the first answer. Requests go to
``/v1/chat/completions`` streamed, with no ``ignore_eos``: answers end where the model ends them
or at ``max_tokens``.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pydoc_data.topics import topics
from typing import Any

import httpx

from bench.loadgen import Target, run_scheduled, run_workers, stream_request
from bench.metrics import RequestRecord

INSTRUCTIONS = (
    "Summarize this passage in three sentences.",
    "What is the main point of this passage?",
    "Explain this passage to someone new to programming.",
    "List the key terms this passage defines, one per line.",
    "Which part of this passage is the easiest to get wrong, and why?",
)
FOLLOW_UPS = (
    "Can you give a short example?",
    "Say that again more simply.",
    "What should I read about next?",
)
FOLLOW_UP_FRACTION = 1 / 3  # of conversations with a second turn
SYSTEM = (
    "You are the documentation assistant of team {tenant}. Answer briefly and precisely, and say "
    "so when the documentation does not cover a question. The team's style notes follow.\n\n{notes}"
)


@dataclass(frozen=True, slots=True)
class Conversation:
    tenant: str
    system: str
    turns: tuple[str, ...]  # the user's messages, in order
    temperature: float
    max_tokens: int


def passages(min_words: int = 60, max_words: int = 400) -> list[str]:
    """The documentation's paragraphs joined into passages of ``min_words`` to ``max_words``
    words, in a fixed order (the same on every run and machine with the same Python)."""
    out: list[str] = []
    for name in sorted(topics):
        current: list[str] = []
        count = 0
        for paragraph in re.split(r"\n\s*\n", topics[name]):
            words = len(paragraph.split())
            if not words:
                continue
            if count + words > max_words and count >= min_words:
                out.append("\n\n".join(current))
                current, count = [], 0
            if words > max_words:
                continue  # a long code listing or table: not a passage
            current.append(paragraph.strip())
            count += words
        if count >= min_words:
            out.append("\n\n".join(current))
    return out


def conversations(
    num_tenants: int,
    num_conversations: int,
    seed: int,
    max_tokens: int = 128,
    follow_up_fraction: float = FOLLOW_UP_FRACTION,
    sampled_fraction: float = 0.5,
) -> list[Conversation]:
    """``num_conversations`` conversations spread over ``num_tenants`` tenants (t0, t1, ...),
    each on a passage no other conversation of the list uses."""
    rng = random.Random(seed)
    pool = passages()
    if len(pool) < num_tenants + num_conversations:
        raise ValueError(f"the corpus has {len(pool)} passages, fewer than the workload needs")
    chosen = rng.sample(pool, num_tenants + num_conversations)
    systems = [SYSTEM.format(tenant=f"t{t}", notes=chosen[t]) for t in range(num_tenants)]
    out = []
    for i in range(num_conversations):
        tenant = i % num_tenants
        passage = chosen[num_tenants + i]
        first = f"{passage}\n\n{rng.choice(INSTRUCTIONS)}"
        turns = (first, rng.choice(FOLLOW_UPS)) if rng.random() < follow_up_fraction else (first,)
        temperature = 0.7 if rng.random() < sampled_fraction else 0.0
        out.append(Conversation(f"t{tenant}", systems[tenant], turns, temperature, max_tokens))
    return out


def chat_messages(
    conversation: Conversation, answers: Sequence[str], turn: int
) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": conversation.system}]
    for i in range(turn + 1):
        messages.append({"role": "user", "content": conversation.turns[i]})
        if i < turn:
            messages.append({"role": "assistant", "content": answers[i]})
    return messages


def chat_body(
    target: Target, conversation: Conversation, answers: Sequence[str], turn: int
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": target.model,
        "messages": chat_messages(conversation, answers, turn),
        "max_tokens": conversation.max_tokens,
        "temperature": conversation.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    # No per-request seed: vLLM's CPU build fails its whole engine on one ("CPU Generator does
    # not use offset", 0.32.0), so sampled answers differ from run to run on both servers.
    return body


async def converse(
    target: Target, client: httpx.AsyncClient, conversation: Conversation, stop_at: float
) -> list[RequestRecord]:
    """The conversation's turns in order, each sent as soon as the answer before it has
    arrived and carrying it; stops at the first failed turn."""
    records: list[RequestRecord] = []
    answers: list[str] = []
    for turn in range(len(conversation.turns)):
        texts: list[str] = []
        body = chat_body(target, conversation, answers, turn)
        path = "/v1/chat/completions"
        record = await stream_request(
            client, target, conversation.tenant, path, body, texts, stop_at
        )
        records.append(record)
        if not record.ok:
            break
        answers.append("".join(texts))
    return records


async def run_conversations(
    target: Target,
    items: Sequence[Conversation],
    concurrency: int,
    deadline_s: float = 600.0,
) -> list[RequestRecord]:
    """Keep ``concurrency`` conversations going until the list is done or the deadline passes
    (a closed loop)."""
    return await run_workers(items, partial(converse, target), concurrency, deadline_s)


async def run_open_loop(
    target: Target,
    items: Sequence[Conversation],
    offsets: Sequence[float],
    deadline_s: float,
) -> list[RequestRecord]:
    """Start each conversation at its offset (seconds from the start) however many are still
    running (an open loop); whatever runs at ``deadline_s`` is cut off."""
    return await run_scheduled(items, offsets, partial(converse, target), deadline_s)
