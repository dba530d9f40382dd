"""The shortest way out: a completion that makes a matcher's output valid, for ``max_tokens``.

A search over single bytes from the matcher's state (forks of it, so the request's own state is
untouched): deterministic stretches are taken whole (xgrammar's jump-forward string), and where
the grammar allows a choice, closing characters are tried first (quote, brace, bracket, then
the shortest values), depth first, within a node budget. ``ByteTable`` turns the completion
into token ids the matcher accepts.
"""

from __future__ import annotations

import contextlib
import string
from collections.abc import Callable

import numpy as np
import xgrammar

# The order in which bytes are tried where the grammar leaves a choice: what closes first, then
# the shortest values (0, null, true, false, empty containers), then any other ASCII, then the
# bytes that continue or start a multi-byte character.
PREFERENCE = [
    ord(c)
    for c in dict.fromkeys(
        '"}],:0ntf{[123456789-.eE' + string.ascii_letters + string.punctuation + " "
    )
]
PREFERENCE += [b for b in range(0x80, 0x100)]
FIRST_TRIES = b'"}],:0'  # tried directly (a fork each) before asking for the allowed bytes
MAX_NODES = 400  # bytes tried per search, at most
MAX_MASKS = 16  # allowed-byte masks computed per search, at most (each fills a whole bitmask)
MAX_BYTES = 256  # longest completion searched for


class ByteTable:
    """Tokens of the vocabulary that are one byte each, for searching and forcing."""

    __slots__ = ("_encode", "byte_values", "calm", "ids", "vocab_size")

    def __init__(self, info: xgrammar.TokenizerInfo, encode: Callable[[str], list[int]]) -> None:
        self._encode = encode
        special = set(info.special_token_ids)
        by_byte: dict[int, int] = {}
        for token_id, raw in enumerate(info.decoded_vocab):
            if len(raw) == 1 and raw[0] not in by_byte and token_id not in special:
                by_byte[raw[0]] = token_id
        order = [b for b in PREFERENCE if b in by_byte]
        self.byte_values = order
        self.ids = np.array([by_byte[b] for b in order], dtype=np.int64)  # preference order
        self.vocab_size = info.vocab_size
        # Tokens that open nothing new: no brace, bracket or comma in their bytes.
        calm = np.zeros((self.vocab_size + 31) // 32, dtype=np.uint32)
        for token_id, raw in enumerate(info.decoded_vocab):
            if not any(b in raw for b in b"{[,"):
                calm[token_id >> 5] |= np.uint32(1 << (token_id & 31))
        self.calm = calm  # [ceil(vocab / 32)] bitmask words

    def allowed(self, matcher: xgrammar.GrammarMatcher) -> list[int]:
        """The bytes the matcher accepts next, in preference order."""
        bitmask = xgrammar.allocate_token_bitmask(1, self.vocab_size)
        matcher.fill_next_token_bitmask(bitmask)
        words = bitmask[0].numpy().view(np.uint32)
        bits = (words[self.ids >> 5] >> (self.ids & 31).astype(np.uint32)) & 1
        return [b for b, bit in zip(self.byte_values, bits.tolist(), strict=True) if bit]

    def tokens_for(self, matcher: xgrammar.GrammarMatcher, text: bytes) -> list[int] | None:
        """Token ids for ``text`` that the matcher accepts and after which it is complete: the
        tokenizer's own when they pass (fewer), else one token per byte; None if neither does."""
        candidates: list[list[int]] = []
        with contextlib.suppress(UnicodeDecodeError):  # not when it cuts into a character
            candidates.append(self._encode(text.decode()))
        ids = dict(zip(self.byte_values, self.ids.tolist(), strict=True))
        if all(b in ids for b in text):
            candidates.append([ids[b] for b in text])
        for token_ids in candidates:
            probe = matcher.fork()
            if all(probe.accept_token(t) for t in token_ids) and probe.is_completed():
                return token_ids
        return None


def completion(matcher: xgrammar.GrammarMatcher, table: ByteTable) -> bytes | None:
    """Bytes after which the matcher's grammar is complete (b"" if it is already), or None when
    the search finds none within its budget."""
    budget = [MAX_NODES, MAX_MASKS]

    def search(node: xgrammar.GrammarMatcher, depth: int) -> bytes | None:
        if node.is_completed():
            return b""
        if depth <= 0 or budget[0] <= 0:
            return None
        budget[0] -= 1
        try:
            jump = node.find_jump_forward_string().encode()
        except UnicodeDecodeError:  # the way forward ends inside a character: go byte by byte
            jump = b""
        if jump:
            child = node.fork()
            if not child.accept_string(jump):
                return None
            rest = search(child, depth - len(jump))
            return None if rest is None else jump + rest
        for byte in FIRST_TRIES:
            rest = step(node, byte, depth)
            if rest is not None:
                return bytes([byte]) + rest
            if budget[0] <= 0:
                return None
        if budget[1] <= 0:
            return None
        budget[1] -= 1
        for byte in table.allowed(node):
            if byte in FIRST_TRIES:
                continue
            rest = step(node, byte, depth)
            if rest is not None:
                return bytes([byte]) + rest
            if budget[0] <= 0:
                break
        return None

    def step(node: xgrammar.GrammarMatcher, byte: int, depth: int) -> bytes | None:
        child = node.fork()
        return search(child, depth - 1) if child.accept_string(bytes([byte])) else None

    return search(matcher, MAX_BYTES)
