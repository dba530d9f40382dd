"""Per-request sampling settings and their validation (no torch)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine.errors import InvalidRequestError
from engine.structured.spec import GrammarSpec

# Temperatures below this are greedy (as in vLLM): dividing float32 logits by less overflows them,
# or by a value that underflows to 0 (1e-300) turns every probability into NaN.
GREEDY_TEMPERATURE = 1e-5
MAX_LOGPROBS = 20  # alternatives per token (OpenAI's top_logprobs limit)
MAX_LOGIT_BIAS = 300  # biased tokens per request
MAX_STOP_TOKEN_IDS = 256  # checked against every generated token


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
    # Penalties over the tokens generated so far (OpenAI's), and over prompt and output tokens
    # (repetition, a multiplier as in vLLM and transformers); 0, 0 and 1 leave logits unchanged.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    min_tokens: int = 0  # EOS, stop_token_ids and stop strings cannot end the output before
    # None: no logprobs; k >= 0: each output token's logprob and the k most likely alternatives.
    logprobs: int | None = None
    grammar: GrammarSpec | None = None  # the output must match it (engine/structured/)
    extra: dict[str, object] = field(default_factory=dict)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def processes_logits(self) -> bool:
        """Whether the logits are changed before sampling (penalties, bias, min_tokens)."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
            or bool(self.logit_bias)
            or self.min_tokens > 0
        )

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
        ids = self.stop_token_ids
        if len(ids) > MAX_STOP_TOKEN_IDS or any(t < 0 for t in ids):
            raise InvalidRequestError(
                f"stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} non-negative ids",
                "stop_token_ids",
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not math.isfinite(value) or not -2.0 <= value <= 2.0:
                raise InvalidRequestError(f"{name} must be between -2 and 2", name)
        penalty = self.repetition_penalty
        if not math.isfinite(penalty) or not 0.0 < penalty <= 2.0:
            raise InvalidRequestError("repetition_penalty must be in (0, 2]", "repetition_penalty")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidRequestError(
                f"logit_bias takes at most {MAX_LOGIT_BIAS} tokens", "logit_bias"
            )
        for token_id, bias in self.logit_bias:
            if token_id < 0 or not math.isfinite(bias) or not -100.0 <= bias <= 100.0:
                raise InvalidRequestError(
                    "logit_bias maps token ids to biases between -100 and 100", "logit_bias"
                )
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequestError("min_tokens must be between 0 and max_tokens", "min_tokens")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidRequestError(f"logprobs must be between 0 and {MAX_LOGPROBS}", "logprobs")
