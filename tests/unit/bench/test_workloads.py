"""The ideal prefix-cache hit rate of workloads, and the shapes of the generated prompts."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from bench.text_workloads import (
    TextShape,
    flood_specs,
    ideal_text_hit_rate,
    shared_prefix_specs,
    word_vocab,
)
from bench.workloads import (
    ChatShape,
    ChatSource,
    SharedPrefixShape,
    ideal_cached_tokens,
    ideal_hit_rate,
    shared_prefix_prompts,
)


def test_ideal_cached_tokens_reuses_whole_pages_of_earlier_prompts_only() -> None:
    base = list(range(10))
    prompts = [
        ("a", base),  # nothing cached yet
        ("a", [*base[:9], 99]),  # shares 9 tokens: two full pages of 4
        ("b", base),  # another namespace: nothing
        ("a", base),  # all but the last token may be reused: 9 -> two pages
        ("a", base[:8]),  # 7 usable tokens: one page
    ]
    assert ideal_cached_tokens(prompts, page_size=4) == [0, 8, 0, 8, 4]


def test_ideal_hit_rate_of_the_shared_prefix_shape() -> None:
    shape = SharedPrefixShape(2, 3, 4, system_len=64, question_len=16, output_len=1)
    prompts = shared_prefix_prompts(shape, seed=1)
    assert len(prompts) == shape.num_requests == 24
    assert {p.tenant for p in prompts} == {"t0", "t1"}
    # Every prompt but the first of each group reuses its whole 64-token system prompt.
    expected = (24 - 6) * 64 / (24 * 80)
    assert ideal_hit_rate(prompts, page_size=16) == pytest.approx(expected)
    # The first T×G prompts are all different groups: they cannot reuse anything.
    assert len({(p.tenant, p.group) for p in prompts[:6]}) == 6


def test_chat_source_sends_a_users_next_turn_only_after_its_answer() -> None:
    source = ChatSource(ChatShape(num_users=2, num_turns=2, system_len=8, turn_len=4))
    first = source.next_prompt()
    second = source.next_prompt()
    assert first is not None and second is not None
    assert (first.group, second.group) == (0, 1)
    assert source.next_prompt() is None  # both users wait for answers
    source.finished(first, [7, 7, 7])
    follow = source.next_prompt()
    assert follow is not None and follow.group == 0
    assert follow.token_ids[: len(first.token_ids) + 3] == (*first.token_ids, 7, 7, 7)
    assert len(follow.token_ids) == len(first.token_ids) + 3 + 4
    assert not source.exhausted
    source.finished(second, [1])
    assert source.next_prompt() is not None
    assert source.exhausted


def _tokenizer_json(tmp_path: Path) -> Path:
    rng = random.Random(0)
    vocab = {"\u0120" + "".join(rng.choice("abcdefgh") for _ in range(5)): i for i in range(150)}
    vocab.update({"\u0120Caps": 150, "\u0120ab": 151, "plain": 152})
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps({"model": {"vocab": vocab}}), encoding="utf-8")
    return path


def test_word_vocab_keeps_lowercase_whole_words_with_a_space(tmp_path: Path) -> None:
    words = word_vocab(_tokenizer_json(tmp_path))
    assert all(w.startswith(" ") and w[1:].isalpha() and w[1:].islower() for w in words)
    assert " Caps" not in words and " ab" not in words and "plain" not in words


def test_text_workloads_share_system_prompts_within_a_tenant(tmp_path: Path) -> None:
    words = word_vocab(_tokenizer_json(tmp_path))
    shape = TextShape(2, 2, 3, system_len=32, question_len=8, output_len=4)
    specs = shared_prefix_specs(words, shape)
    assert len(specs) == 12

    def encode(text: str) -> list[int]:
        return [hash(w) for w in text.split(" ")[1:]]

    assert all(len(encode(s.prompt)) == 40 for s in specs)
    # 8 of the 12 prompts reuse their 32-word system prompt: two full pages of 16.
    assert ideal_text_hit_rate(specs, encode, 16) == pytest.approx(8 * 32 / (12 * 40))
    flood = flood_specs(words, 3, 2, 10, 16, 4)
    assert {t: len(s) for t, s in flood.items()} == {"t0": 20, "t1": 2, "t2": 2}
