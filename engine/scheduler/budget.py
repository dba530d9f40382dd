"""The step budget: how many decodes and prompt tokens a step takes, from its measured cost.

A step's time is modelled as ``fixed + scale × (per_decode × decodes + per_prefill × tokens)``:
the three costs are measured when the engine starts (``engine/step_calibration.py``) and the
scale follows the measured time of every step (contexts grow, the machine's load moves; the fixed
part, reading the weights once, does not). Every running request gets a token a step, so the
step time is their time per output token: the TPOT target bounds the decodes a step holds
(``max_decodes``, keeping room for prompts) and the prompt tokens beside them (``prefill_room``).
The TTFT side is ``horizon``: how long a prompt needs to its first token at these rates. A prompt
whose deadline is that near may go beyond the room (the scheduler's rule), so under overload both
sides stretch rather than one starving.

Pure Python, no torch: the scheduler's tests drive it with made-up costs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# The default TPOT target keeps this fraction of the decode throughput that an unbounded batch
# would reach on the machine (see ``StepCosts.auto_target_s``).
DEFAULT_EFFICIENCY = 0.8
# The scale moves this fraction of the way to each step's measured/modelled ratio, taken within
# a factor MAX_RATIO of 1 (a half-life of about sixteen steps: one slow step, a page fault or
# another process, barely moves it).
SCALE_SMOOTHING = 0.042
MAX_RATIO = 8.0
DEFAULT_TTFT_S = 2.0  # a request's first-token deadline when its tenant sets none


@dataclass(frozen=True, slots=True)
class StepCosts:
    """Seconds a step costs: once, per decode row, per prefill (or draft) token."""

    fixed_s: float
    per_decode_s: float
    per_prefill_token_s: float

    def __post_init__(self) -> None:
        values = (self.fixed_s, self.per_decode_s, self.per_prefill_token_s)
        if not all(math.isfinite(v) for v in values) or self.fixed_s < 0:
            raise ValueError("step costs must be finite and the fixed cost non-negative")
        if self.per_decode_s <= 0 or self.per_prefill_token_s <= 0:
            raise ValueError("per-row step costs must be positive")

    def auto_target_s(self, efficiency: float = DEFAULT_EFFICIENCY) -> float:
        """The step time at which decoding reaches ``efficiency`` of its best throughput.

        ``d`` decodes a step give ``d / (fixed + per_decode·d)`` tokens a second, approaching
        ``1 / per_decode``; that fraction is reached at ``d = e / (1 - e) · fixed /
        per_decode``, where a step takes ``fixed / (1 - e)``.
        """
        if not 0 < efficiency < 1:
            raise ValueError("efficiency must be between 0 and 1")
        return max(self.fixed_s / (1 - efficiency), self.fixed_s + self.per_decode_s)


@dataclass(slots=True)
class StepBudget:
    """What fits a step within ``target_s`` (the TPOT target), by the costs times the scale;
    without costs (not measured) every step may take the whole token budget."""

    target_s: float | None = None
    costs: StepCosts | None = None
    ttft_s: float = DEFAULT_TTFT_S
    min_prefill_tokens: int = 16  # a step always moves prompts on by this much (a page)
    scale: float = 1.0

    def __post_init__(self) -> None:
        target = self.target_s
        if target is not None and (not target > 0 or not math.isfinite(target)):
            raise ValueError("the step-time target must be a positive number of seconds")
        if not self.ttft_s > 0 or not math.isfinite(self.ttft_s):
            raise ValueError("the first-token target must be a positive number of seconds")
        if self.min_prefill_tokens <= 0:
            raise ValueError("min_prefill_tokens must be positive")

    def predict_s(self, num_decodes: int, num_prefill_tokens: int) -> float:
        costs = self.costs
        if costs is None:
            return 0.0
        return costs.fixed_s + self.scale * (
            costs.per_decode_s * num_decodes + costs.per_prefill_token_s * num_prefill_tokens
        )

    def max_decodes(self, limit: int) -> int:
        """The most decodes a step holds within the target with a page of prompt beside them
        (at least one, at most ``limit``)."""
        costs = self.costs
        if costs is None or self.target_s is None:
            return limit
        room = self.target_s - self.predict_s(0, self.min_prefill_tokens)
        return min(limit, max(1, int(room / (self.scale * costs.per_decode_s))))

    def prefill_room(self, num_decodes: int, limit: int) -> int:
        """Prompt (and draft) tokens that fit beside ``num_decodes`` decodes within the target;
        at least ``min_prefill_tokens``, at most ``limit``."""
        costs = self.costs
        if costs is None or self.target_s is None:
            return limit
        room = self.target_s - self.predict_s(num_decodes, 0)
        tokens = int(room / (self.scale * costs.per_prefill_token_s)) if room > 0 else 0
        return min(limit, max(self.min_prefill_tokens, tokens))

    def horizon_s(self, num_tokens: int, num_decodes: int, limit: int) -> float:
        """Seconds a prompt of ``num_tokens`` uncached tokens needs to its first token if it
        starts now: the step in flight, then its chunks at the room the decodes leave."""
        if self.costs is None:
            return 0.0
        room = self.prefill_room(num_decodes, limit)
        steps = 1 + -(-num_tokens // room)
        return (
            steps * self.predict_s(num_decodes, 0)
            + self.predict_s(0, num_tokens)
            - (self.costs.fixed_s)
        )

    def observe(self, num_decodes: int, num_prefill_tokens: int, seconds: float) -> None:
        """Follow the scale by a step that ran ``num_decodes`` decodes and
        ``num_prefill_tokens`` other tokens in ``seconds``."""
        costs = self.costs
        if costs is None or num_decodes + num_prefill_tokens <= 0 or not seconds > 0:
            return
        rows = costs.per_decode_s * num_decodes + costs.per_prefill_token_s * num_prefill_tokens
        ratio = min(max((seconds - costs.fixed_s) / rows, 1 / MAX_RATIO), MAX_RATIO)
        self.scale += SCALE_SMOOTHING * (ratio - self.scale)
