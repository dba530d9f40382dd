"""Incremental detokenization and stop conditions: text deltas, stop strings, EOS and length.

Text is emitted only once it is valid UTF-8 and can no longer become part of a stop string.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import NamedTuple, Protocol

from engine.sampling_params import SamplingParams

NUM_CONTEXT_TOKENS = 6  # prompt tokens decoded before the first output (leading-space rules)
REPLACEMENT_CHAR = "\ufffd"


class TokenDecoder(Protocol):
    def decode(self, token_ids: Sequence[int]) -> str: ...


class DetokenizerStep(NamedTuple):
    text: str  # new text to emit
    finish_reason: str | None  # "stop" | "length" | None while generating


class IncrementalDetokenizer:
    """Per-request text state; ``update`` is called once per generated token."""

    __slots__ = (
        "_decoder",
        "_emitted",
        "_eos_token_ids",
        "_max_stop_len",
        "_prefix_offset",
        "_read_offset",
        "_window",
        "params",
        "text",
    )

    def __init__(
        self,
        decoder: TokenDecoder,
        params: SamplingParams,
        prompt_token_ids: Sequence[int],
        eos_token_ids: Collection[int],
    ) -> None:
        self._decoder = decoder
        self.params = params
        self._eos_token_ids = frozenset() if params.ignore_eos else frozenset(eos_token_ids)
        # Only a short window of ids is kept: the tokens since the last emitted boundary.
        self._window = list(prompt_token_ids[-NUM_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._window)
        self._max_stop_len = max((len(s) for s in params.stop), default=0)
        self.text = ""  # the output text so far, stop string cut
        self._emitted = 0  # characters of ``text`` already handed out

    def update(self, token_id: int, num_output_tokens: int) -> DetokenizerStep:
        """Account for a new token (the ``num_output_tokens``-th); returns text and finish."""
        may_stop = num_output_tokens >= self.params.min_tokens
        if may_stop and (token_id in self.params.stop_token_ids or token_id in self._eos_token_ids):
            return DetokenizerStep(self.flush(), "stop")
        start = max(0, len(self.text) - self._max_stop_len + 1)
        self.text += self._decode_next(token_id)
        if self._max_stop_len and may_stop:
            cut = self._find_stop(start)
            if cut is not None:
                self.text = self.text[:cut]
                return DetokenizerStep(self.flush(), "stop")
        if num_output_tokens >= self.params.max_tokens:
            return DetokenizerStep(self.flush(), "length")
        end = len(self.text) - self._held_back()
        delta = self.text[self._emitted : end]
        self._emitted = max(self._emitted, end)
        return DetokenizerStep(delta, None)

    def flush(self) -> str:
        """All text not yet emitted (held-back text included): the request is ending."""
        delta = self.text[self._emitted :]
        self._emitted = len(self.text)
        return delta

    def _decode_next(self, token_id: int) -> str:
        self._window.append(token_id)
        decode = self._decoder.decode
        prefix_text = decode(self._window[self._prefix_offset : self._read_offset])
        new_text = decode(self._window[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""  # an incomplete UTF-8 sequence: wait for the next token
        delta = new_text[len(prefix_text) :]
        del self._window[: self._read_offset]
        self._prefix_offset = 0
        self._read_offset = len(self._window)
        return delta

    def _find_stop(self, start: int) -> int | None:
        """Where to cut the text at the earliest stop string found at or after ``start``."""
        best_index = -1
        best_cut: int | None = None
        for stop in self.params.stop:
            index = self.text.find(stop, start)
            if index >= 0 and (best_index < 0 or index < best_index):
                best_index = index
                include = self.params.include_stop_str_in_output
                best_cut = index + len(stop) if include else index
        return best_cut

    def _held_back(self) -> int:
        """Length of the longest unemitted suffix that could still grow into a stop string."""
        longest = min(self._max_stop_len - 1, len(self.text) - self._emitted)
        for size in range(longest, 0, -1):
            tail = self.text[-size:]
            if any(stop.startswith(tail) for stop in self.params.stop):
                return size
        return 0
