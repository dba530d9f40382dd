"""Per-request sampling settings and their validation (no torch)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine.errors import InvalidRequestError
from engine.structured.spec import GrammarSpec

# Temperatures below this are greedy (as in vLLM): dividing float32 logits by less overflows them,
# or by a value that underflows to 0 (1e-300) turns every probability into NaN.
GREEDY_TEMPERATURE = 1e-5


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request's tokens are chosen and when it stops.

    temperature 0 (or anything below ``GREEDY_TEMPERATURE``, 1e-5) means greedy; top_k 0 (or -1)
    means no top-k; top_p 1.0 and min_p 0.0 disable those filters. ``seed`` makes sampling
    reproducible whatever else shares the batch.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    grammar: GrammarSpec | None = None  # the output must match it (engine/structured/)
    extra: dict[str, object] = field(default_factory=dict)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    def validate(self) -> None:
        """Raise InvalidRequestError naming the offending parameter."""
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise InvalidRequestError("max_tokens must be a positive integer", "max_tokens")
        if not math.isfinite(self.temperature) or not 0.0 <= self.temperature <= 2.0:
            raise InvalidRequestError("temperature must be between 0 and 2", "temperature")
        if not math.isfinite(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError("top_p must be in (0, 1]", "top_p")
        if self.top_k < -1:
            raise InvalidRequestError("top_k must be -1, 0 or positive", "top_k")
        if not math.isfinite(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError("min_p must be in [0, 1]", "min_p")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise InvalidRequestError("seed must be a non-negative 64-bit integer", "seed")
        if len(self.stop) > 16 or any(not s for s in self.stop):
            raise InvalidRequestError("stop takes at most 16 non-empty strings", "stop")
        if any(t < 0 for t in self.stop_token_ids):
            raise InvalidRequestError("stop_token_ids must be non-negative", "stop_token_ids")
