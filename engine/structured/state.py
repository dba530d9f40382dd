"""A request's grammar state: its matcher, the rows of a step's bitmask, and how it ends.

The matcher advances only on tokens the engine accepts. Masks for a drafted decode walk the
draft on a fork of the matcher, so a draft token the grammar forbids is masked out of its own
row and ends acceptance there. Near ``max_tokens`` the state plans a completion (see
``closing.py``) and forces its tokens, so a cut output still parses; it then ends as "length".
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
import torch
import xgrammar

from engine.structured.closing import completion
from engine.structured.compiler import GrammarCompiler

# Tokens kept in hand beyond a planned completion: one free token may lengthen the way out.
CLOSE_SLACK = 3
CHECK_WITHIN = 64  # tokens from the planned end within which the completion is rechecked each step
CALM_WINDOW = 16  # tokens before the close within which nothing new may be opened
RECHECK_EVERY = 16  # steps between completion estimates while the end is further


@dataclass(slots=True, eq=False)
class GrammarState:
    compiled: Future[xgrammar.CompiledGrammar]
    compiler: GrammarCompiler
    matcher: xgrammar.GrammarMatcher | None = None
    error: str | None = None
    forced: deque[int] = field(default_factory=deque)  # completion tokens still to emit
    closing: bool = False  # the completion has been planned: the output ends with it
    close_estimate: int = 0  # tokens of the last planned completion
    steps_to_check: int = 0
    planned: list[int] = field(default_factory=list)  # the last planned completion's tokens
    planned_text: bytes | None = None  # and its bytes: often still a way out a step later
    calm: bool = False  # within CALM_WINDOW tokens of having to close

    def ready(self) -> xgrammar.GrammarMatcher | None:
        """The matcher, once the grammar is compiled (waits for it); None if compiling failed."""
        if self.matcher is None and self.error is None:
            try:
                self.matcher = xgrammar.GrammarMatcher(self.compiled.result())
            except Exception as exc:
                self.error = f"the grammar could not be compiled: {exc}"
        return self.matcher

    @property
    def closed(self) -> bool:
        """The planned completion has been emitted: the output is complete and must end."""
        return self.closing and not self.forced

    def fill(self, bitmask: torch.Tensor, row: int, draft: tuple[int, ...], remaining: int) -> None:
        """Fill ``bitmask[row]`` for the next token (``remaining`` of max_tokens left) and the
        rows that follow it for the tokens of ``draft``."""
        matcher = self.ready()
        if matcher is None:
            return  # the request fails after this step; its rows stay unmasked
        self.plan(remaining, 1 + len(draft))
        if self.forced:
            self._fill_forced(bitmask, row, draft)
            return
        matcher.fill_next_token_bitmask(bitmask, row)
        walker = matcher.fork() if draft else None
        for i, token_id in enumerate(draft):
            assert walker is not None
            if not walker.accept_token(token_id) or walker.is_terminated():
                break  # acceptance ends at this draft token: later rows are never used
            walker.fill_next_token_bitmask(bitmask, row + i + 1)
        if self.calm and not self._calm_rows(bitmask, row, len(draft) + 1):
            self.closing = True  # nothing calm is allowed: close now, while it still fits
            self.forced.extend(self.planned)
            self._fill_forced(bitmask, row, draft)

    def _calm_rows(self, bitmask: torch.Tensor, row: int, num_rows: int) -> bool:
        """Near the end, allow only tokens that open nothing new (no brace, bracket or comma)
        and the planned completion's next token, so one token cannot lengthen the way out past
        what is left; False if the next token then has no choice at all."""
        table = self.compiler.table
        if table is None:
            return True
        words = bitmask.numpy().view(np.uint32)  # shares memory with ``bitmask``
        allowed = words[row].copy()
        words[row : row + num_rows] &= table.calm
        if self.planned:  # the way out itself never lengthens the way out
            token_id = self.planned[0]
            bit = np.uint32(1 << (token_id & 31))
            words[row, token_id >> 5] |= allowed[token_id >> 5] & bit
        return bool(words[row].any())

    def _fill_forced(self, bitmask: torch.Tensor, row: int, draft: tuple[int, ...]) -> None:
        """One allowed token per row: the planned completion, as far as the draft follows it."""
        forced = list(self.forced)
        words = bitmask.numpy().view(np.uint32)  # shares memory with ``bitmask``
        for i in range(min(len(draft) + 1, len(forced))):
            if i > 0 and draft[i - 1] != forced[i - 1]:
                return
            token_id = forced[i]
            words[row + i] = 0
            words[row + i, token_id >> 5] = 1 << (token_id & 31)

    def accept(self, token_id: int) -> bool:
        """Advance on an accepted token; False if the grammar refuses it."""
        matcher = self.ready()
        if matcher is None or not matcher.accept_token(token_id):
            return False
        if self.forced and self.forced[0] == token_id:
            self.forced.popleft()
        elif self.forced:  # another token got through (a row with no finite logit): plan again
            self.forced.clear()
            self.closing = False
            self.planned_text = None
        return True

    def plan(self, remaining: int, lookahead: int = 1) -> None:
        """Decide, with ``remaining`` tokens left of which this step may take ``lookahead`` (one
        plus a draft), whether the output must start closing now."""
        matcher = self.matcher
        if self.closing or matcher is None or matcher.is_terminated():
            return
        margin = remaining - self.close_estimate - CLOSE_SLACK - lookahead
        if margin > CHECK_WITHIN and self.steps_to_check > 0:
            self.steps_to_check -= 1
            return
        self.steps_to_check = RECHECK_EVERY
        table = self.compiler.table
        if table is None:
            return
        text = self.planned_text
        probe = matcher.fork()
        if text is None or not (probe.accept_string(text) and probe.is_completed()):
            text = completion(matcher, table)  # the last way out no longer leads out: search
        token_ids = None if text is None else table.tokens_for(matcher, text) if text else []
        if text is None or token_ids is None:
            self.planned_text = None
            return  # no way out found: the output may be cut where max_tokens falls
        self.planned_text = text
        self.close_estimate = len(token_ids)
        self.planned = token_ids
        needed = len(token_ids) + CLOSE_SLACK + lookahead
        self.calm = remaining <= needed + CALM_WINDOW
        if remaining <= needed:
            self.closing = True
            self.forced.extend(token_ids)
