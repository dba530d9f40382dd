"""Serving workloads as text: shared-prefix tenants, multi-turn chats and a flooding tenant.

Texts are runs of whole-word vocabulary entries (" word"), so a text of n words is close to n
tokens and tokenizes the same on every server using the model's own tokenizer.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.loadgen import RequestSpec
from bench.workloads import ideal_cached_tokens

_WORD = re.compile(r"^\u0120[a-z]{3,9}$")  # byte-level BPE marks a leading space with "Ġ"


def word_vocab(tokenizer_json: Path) -> list[str]:
    """Single-token words with a leading space, from a tokenizer.json's BPE vocabulary."""
    body = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    vocab = body["model"]["vocab"]
    words = sorted(" " + token[1:] for token in vocab if _WORD.match(token))
    if len(words) < 100:
        raise ValueError("the tokenizer has too few whole-word tokens")
    return words


def make_text(rng: random.Random, words: Sequence[str], n: int) -> str:
    return "".join(rng.choice(words) for _ in range(n))


@dataclass(frozen=True, slots=True)
class TextShape:
    num_tenants: int = 4
    num_groups: int = 4
    num_prompts: int = 16
    system_len: int = 1024
    question_len: int = 128
    output_len: int = 64


def shared_prefix_specs(words: Sequence[str], shape: TextShape, seed: int = 0) -> list[RequestSpec]:
    """T tenants × G system prompts × P questions, interleaved so tenants and groups alternate."""
    rng = random.Random(seed)
    systems = {
        (t, g): make_text(rng, words, shape.system_len)
        for t in range(shape.num_tenants)
        for g in range(shape.num_groups)
    }
    specs = []
    for _ in range(shape.num_prompts):
        for g in range(shape.num_groups):
            for t in range(shape.num_tenants):
                question = make_text(rng, words, shape.question_len)
                specs.append(RequestSpec(f"t{t}", systems[(t, g)] + question, shape.output_len))
    return specs


def chat_sessions(
    words: Sequence[str],
    num_users: int,
    num_turns: int,
    system_len: int,
    turn_len: int,
    num_tenants: int,
    seed: int = 0,
) -> list[tuple[str, list[str]]]:
    """Users spread over tenants; each user's first message carries its system prompt."""
    rng = random.Random(seed)
    sessions = []
    for user in range(num_users):
        turns = [make_text(rng, words, turn_len) for _ in range(num_turns)]
        turns[0] = make_text(rng, words, system_len) + turns[0]
        sessions.append((f"t{user % num_tenants}", turns))
    return sessions


def flood_specs(
    words: Sequence[str],
    num_tenants: int,
    per_tenant: int,
    factor: int,
    prompt_len: int,
    output_len: int,
    seed: int = 0,
) -> dict[str, list[RequestSpec]]:
    """Tenant t0 sends ``factor`` times as many requests as each other tenant."""
    rng = random.Random(seed)
    out: dict[str, list[RequestSpec]] = {}
    for t in range(num_tenants):
        count = per_tenant * (factor if t == 0 else 1)
        out[f"t{t}"] = [
            RequestSpec(f"t{t}", make_text(rng, words, prompt_len), output_len)
            for _ in range(count)
        ]
    return out


def ideal_text_hit_rate(
    specs: Sequence[RequestSpec], encode: Callable[[str], list[int]], page_size: int
) -> float:
    """The ideal cached fraction of the prompts in order, per-tenant namespaces."""
    tokenized = [(spec.tenant, encode(spec.prompt)) for spec in specs]
    cached = ideal_cached_tokens(tokenized, page_size)
    total = sum(len(tokens) for _, tokens in tokenized)
    return sum(cached) / total if total else 0.0
