"""OpenAI's ``logprobs`` objects (chat and completions) from the engine's token logprobs.

A token is shown as its own decoded text (special tokens included); a token that ends inside a
multi-byte character decodes to U+FFFD, as it does in vLLM. ``-inf`` becomes -9999.0, which JSON
can carry.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

from engine.outputs import TokenLogprob
from web.openai.schemas import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob

FLOOR = -9999.0


class TokenText(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class TokenNames:
    """Each token id's text, decoded once per answer."""

    __slots__ = ("_names", "_tokenizer")

    def __init__(self, tokenizer: TokenText) -> None:
        self._tokenizer = tokenizer
        self._names: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        name = self._names.get(token_id)
        if name is None:
            name = self._tokenizer.decode([token_id], skip_special_tokens=False)
            self._names[token_id] = name
        return name


def _value(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else FLOOR


def chat_logprobs(names: TokenNames, entries: Sequence[TokenLogprob]) -> ChatLogprobs:
    content = []
    for entry in entries:
        token = names(entry.token_id)
        top = [
            TopLogprob(names(t), _value(v), list(names(t).encode("utf-8"))) for t, v in entry.top
        ]
        content.append(
            ChatTokenLogprob(token, _value(entry.logprob), list(token.encode("utf-8")), top)
        )
    return ChatLogprobs(content)


def completion_logprobs(
    names: TokenNames, entries: Sequence[TokenLogprob], text_offset: int
) -> CompletionLogprobs:
    """``text_offset``: where the first token's text starts in the choice's whole text."""
    tokens: list[str] = []
    values: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for entry in entries:
        token = names(entry.token_id)
        tokens.append(token)
        values.append(_value(entry.logprob))
        # As in vLLM: the sampled token is always among the alternatives shown.
        tops.append({token: _value(entry.logprob)} | {names(t): _value(v) for t, v in entry.top})
        offsets.append(text_offset)
        text_offset += len(token)
    return CompletionLogprobs(tokens, values, tops, offsets)
