"""N-gram drafts for greedy decodes: guess a request's next tokens from its own context.

When the last ``ngram`` tokens of a request already occurred earlier in its prompt or output
(or, failing that, its last ``min_ngram`` .. ``ngram - 1`` tokens), the tokens that followed them
then are proposed as the next ones (prompt lookup decoding). The
engine runs the last token and the draft in one step, one query row each, and keeps the draft
up to the first token that greedy decoding would not have chosen, plus the token the model
chose there: the output is the same as without drafts, in fewer steps.

Each request keeps a dict from n-grams to the index of the token that last followed them, updated
as tokens arrive, so a proposal costs the request's new tokens since its last one, not its
length. A request whose draft was rejected outright drafts again only after a pause that
doubles with each miss (up to ``MAX_PAUSE`` steps), so text that does not repeat costs little.

Pure Python (no torch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.draft_state import DraftState

if TYPE_CHECKING:
    from engine.request import Request

MAX_PAUSE = 16  # steps without drafting after repeated misses, at most


class NgramDrafter:
    """Proposes up to ``num_tokens`` draft tokens for a greedy decode (see the module doc)."""

    __slots__ = ("min_ngram", "ngram", "num_tokens")

    def __init__(self, num_tokens: int, ngram: int = 3, min_ngram: int = 2) -> None:
        if num_tokens <= 0 or min_ngram <= 0 or ngram < min_ngram:
            raise ValueError("num_tokens and min_ngram must be positive, ngram >= min_ngram")
        self.num_tokens = num_tokens
        self.ngram = ngram
        self.min_ngram = min_ngram

    def propose(self, request: Request, limit: int) -> list[int]:
        """Draft tokens to follow ``request.all_token_ids`` (none when nothing matches), at most
        ``limit`` of them; greedy requests whose logits are not changed before sampling
        (penalties depend on the tokens before each row) only."""
        limit = min(limit, self.num_tokens)
        params = request.params
        if limit <= 0 or not params.is_greedy or params.processes_logits:
            return []
        if request.token_in_flight:  # its last token is still on the device (engine/overlap.py)
            return []
        state = request.draft_state
        if state is None:
            state = request.draft_state = DraftState()
        tokens = request.all_token_ids
        length = len(tokens)
        index = state.index
        sizes = range(self.ngram, self.min_ngram - 1, -1)
        for i in range(max(self.min_ngram, state.num_indexed), length):
            for n in sizes:
                if n <= i:
                    index[tuple(tokens[i - n : i])] = i
        state.num_indexed = length
        if state.pause > 0:
            state.pause -= 1
            return []
        start = None
        for n in sizes:  # the longest match first
            if n < length and (start := index.get(tuple(tokens[length - n :]))) is not None:
                break
        if start is None:
            return []
        # What followed the earlier occurrence; past the end the text repeats with the period
        # between the two occurrences.
        period = length - start
        draft = tokens[start : start + limit]
        while len(draft) < limit:
            draft.append(draft[len(draft) - period])
        return draft

    def feedback(self, request: Request, num_drafted: int, num_accepted: int) -> None:
        """Record how a draft fared: an outright miss pauses the request's drafting."""
        state = request.draft_state
        if state is None or num_drafted == 0:
            return
        if num_accepted == 0:
            state.pause = state.next_pause
            state.next_pause = min(2 * state.next_pause, MAX_PAUSE)
        else:
            state.next_pause = 1
