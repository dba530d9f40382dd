"""Benchmark workloads as token ids: tenants × groups × prompts with shared system prompts, chats.

The shapes follow SGLang's generated-shared-prefix benchmark (system prompt S, question Q,
output O); the ideal hit rate is what an unbounded cache would reuse in arrival order.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Prompt:
    tenant: str
    group: int  # the shared system prompt (or chat) this prompt belongs to
    token_ids: tuple[int, ...]
    max_tokens: int


@dataclass(frozen=True, slots=True)
class SharedPrefixShape:
    num_tenants: int = 2
    num_groups: int = 4  # system prompts per tenant
    num_prompts: int = 8  # questions per system prompt
    system_len: int = 512
    question_len: int = 64
    output_len: int = 16

    @property
    def num_requests(self) -> int:
        return self.num_tenants * self.num_groups * self.num_prompts


def _random_tokens(rng: random.Random, n: int, low: int, high: int) -> list[int]:
    return [rng.randrange(low, high) for _ in range(n)]


def shared_prefix_prompts(
    shape: SharedPrefixShape, seed: int = 0, low: int = 100, high: int = 20000
) -> list[Prompt]:
    """Every tenant's groups share a system prompt; prompts are interleaved across groups."""
    rng = random.Random(seed)
    prompts: list[Prompt] = []
    systems = {
        (t, g): _random_tokens(rng, shape.system_len, low, high)
        for t in range(shape.num_tenants)
        for g in range(shape.num_groups)
    }
    for _p in range(shape.num_prompts):
        for g in range(shape.num_groups):
            for t in range(shape.num_tenants):
                question = _random_tokens(rng, shape.question_len, low, high)
                tokens = tuple(systems[(t, g)] + question)
                prompts.append(Prompt(f"t{t}", g, tokens, shape.output_len))
    return prompts


@dataclass(frozen=True, slots=True)
class ChatShape:
    num_users: int = 8
    num_turns: int = 4
    system_len: int = 256
    turn_len: int = 48  # new user tokens per turn
    output_len: int = 16


def chat_turn(history: Sequence[int], user_tokens: Sequence[int]) -> tuple[int, ...]:
    """The next turn's prompt: everything so far (prompts and answers), then the new message."""
    return (*history, *user_tokens)


def chat_user_messages(shape: ChatShape, seed: int = 0) -> list[list[list[int]]]:
    """Per user: the system prompt as turn 0's head, then one message per turn."""
    rng = random.Random(seed)
    users = []
    for _ in range(shape.num_users):
        system = _random_tokens(rng, shape.system_len, 100, 20000)
        turns = [_random_tokens(rng, shape.turn_len, 100, 20000) for _ in range(shape.num_turns)]
        turns[0] = system + turns[0]
        users.append(turns)
    return users


def ideal_cached_tokens(
    prompts: Iterable[tuple[str, Sequence[int]]], page_size: int, seen: set[object] | None = None
) -> list[int]:
    """Tokens an unbounded page-granular cache would reuse for each (namespace, tokens), in order.

    A prompt reuses its longest full-page prefix of ``tokens[:-1]`` already computed by an
    earlier prompt of the same namespace (the last token always runs: its logits give a token).
    Pass ``seen`` to carry the cache across calls (e.g. to add answers of chat turns).
    """
    seen = set() if seen is None else seen
    cached: list[int] = []
    for namespace, tokens in prompts:
        usable = (len(tokens) - 1) // page_size
        keys = page_keys(namespace, tokens, page_size)
        hit = 0
        while hit < usable and keys[hit] in seen:
            hit += 1
        cached.append(hit * page_size)
        seen.update(keys)
    return cached


def page_keys(namespace: str, tokens: Sequence[int], page_size: int) -> list[object]:
    """One key per full page that identifies the whole prefix up to that page (chained)."""
    keys: list[object] = []
    key: object = namespace
    for n in range(len(tokens) // page_size):
        key = hash((key, tuple(tokens[n * page_size : (n + 1) * page_size])))
        keys.append(key)
    return keys


def ideal_hit_rate(prompts: Sequence[Prompt], page_size: int) -> float:
    """Ideal cached tokens over all prompt tokens, prompts taken in list order."""
    cached = ideal_cached_tokens(((p.tenant, p.token_ids) for p in prompts), page_size)
    total = sum(len(p.token_ids) for p in prompts)
    return sum(cached) / total if total else 0.0


class ChatSource:
    """Multi-turn chats: a user's next turn is sent once its previous answer has arrived."""

    def __init__(self, shape: ChatShape, tenant: str = "chat", seed: int = 0) -> None:
        self._messages = chat_user_messages(shape, seed)
        self._history: list[tuple[int, ...]] = [() for _ in self._messages]
        self._turn = [0] * len(self._messages)
        self._busy = [False] * len(self._messages)
        self._tenant = tenant
        self._output_len = shape.output_len

    def next_prompt(self) -> Prompt | None:
        for user, turns in enumerate(self._messages):
            if not self._busy[user] and self._turn[user] < len(turns):
                tokens = chat_turn(self._history[user], turns[self._turn[user]])
                self._busy[user] = True
                self._turn[user] += 1
                return Prompt(self._tenant, user, tokens, self._output_len)
        return None

    def finished(self, prompt: Prompt, answer: Sequence[int]) -> None:
        self._history[prompt.group] = (*prompt.token_ids, *answer)
        self._busy[prompt.group] = False

    @property
    def exhausted(self) -> bool:
        return all(t >= len(m) for t, m in zip(self._turn, self._messages, strict=True))
