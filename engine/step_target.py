"""The step-time target: how many decodes and prefill tokens fit in a step that must stay short.

A step's time is modelled as ``fixed + scale × (per_decode × decodes + per_context × the tokens
those decodes attend to) + prefill_scale × per_prefill × prefill tokens``, with the four costs
measured when the engine starts (``engine/step_calibration.py``) and the two scales, corrected
after every step, for what the model leaves out (the machine's load moves; a prompt chunk deep
into a long prompt attends to more than the calibration's). Each scale is corrected by the share
of the step its rows were predicted to take: a decode-only step moves only the decodes' scale, a
prompt-only step only the prompts'. One scale for both read the cost of a lone decode (whose
Python and launches the fixed part underestimates) as prompts costing twice the calibration,
and a burst of prompts beside one decode was then planned at half the rate it ran at. The
context term keeps a decode over 1,300 tokens, which costs a few times one over the
calibration's 128, from reading as a scale that would also shrink every prompt's share; the steps
ahead are planned at the mean context the recent decodes had. The fixed part (reading the weights
once, launching the layers) does not grow with the contexts, so the scales leave it out: scaling
it too took room from the rows that do grow. Every running
request gets one token a step, so the step time is their time per output token: the scheduler
admits a new request only while one more decode leaves a share of the step (``PREFILL_SHARE`` of
what is not fixed) for prefill, and gives prefill chunks what the decodes leave. Under overload
the rest wait in the admission queue, where the fair-share policy decides who goes next.

Pure Python, no torch: the scheduler's tests drive it with made-up costs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# The default target keeps this fraction of the decode throughput that an unbounded batch
# would reach on the machine (see ``StepCosts.auto_target_s``).
DEFAULT_EFFICIENCY = 0.8
# Of a step's time beyond its fixed cost, what full batches of decodes leave for prefill chunks:
# new requests then start within a few steps rather than at a few tokens a step.
PREFILL_SHARE = 0.25
# Each scale moves a fraction of the way to each step's measured/modelled ratio of the rows' time
# (the step's beyond the fixed cost), times its rows' share of that time: a half-life of about
# sixteen steps of its rows, so one slow step (a page fault, another process) barely moves it.
SCALE_SMOOTHING = 0.042
MIN_SCALE, MAX_SCALE = 0.25, 8.0


@dataclass(frozen=True, slots=True)
class StepCosts:
    """Seconds a step costs: once, per decode row, per token of context a decode attends to, per
    prefill (or draft) token."""

    fixed_s: float
    per_decode_s: float
    per_prefill_token_s: float
    per_context_token_s: float = 0.0

    def __post_init__(self) -> None:
        values = (self.fixed_s, self.per_decode_s, self.per_prefill_token_s)
        if not all(math.isfinite(v) for v in (*values, self.per_context_token_s)):
            raise ValueError("step costs must be finite")
        if self.fixed_s < 0 or self.per_context_token_s < 0:
            raise ValueError("the fixed and context costs must not be negative")
        if self.per_decode_s <= 0 or self.per_prefill_token_s <= 0:
            raise ValueError("per-row step costs must be positive")

    def auto_target_s(self, efficiency: float = DEFAULT_EFFICIENCY) -> float:
        """The step time at which decoding reaches ``efficiency`` of its best throughput.

        ``d`` decodes a step give ``d / (fixed + per_decode·d)`` tokens a second, approaching
        ``1 / per_decode`` as the batch grows; that fraction is reached at
        ``d = e / (1 - e) · fixed / per_decode``, where a step takes ``fixed / (1 - e)``. A
        machine whose steps cost mostly their fixed part (a GPU reading its weights) gets a
        long target and large batches; one whose rows cost most (a small CPU) a short one.
        """
        if not 0 < efficiency < 1:
            raise ValueError("efficiency must be between 0 and 1")
        floor = self.fixed_s + self.per_decode_s  # one decode alone (of a short context)
        return max(self.fixed_s / (1 - efficiency), floor)


@dataclass(slots=True)
class StepTarget:
    """What fits within ``target_s`` a step, by the costs times the running scales."""

    target_s: float
    costs: StepCosts
    min_prefill_tokens: int = 16  # a step always moves prefill on by this much
    scale: float = 1.0  # the decode rows' (and their contexts')
    prefill_scale: float = 1.0  # the prompt (and draft) tokens'
    # How far a first token overdue stretches the target this step (the scheduler sets it from
    # the oldest wait for a first token; 1: nobody is overdue).
    stretch: float = 1.0
    # The tokens a decode attended to in recent steps, on average (smoothed like the scale).
    context_per_decode: float = 0.0

    def __post_init__(self) -> None:
        if not self.target_s > 0 or not math.isfinite(self.target_s):
            raise ValueError("the step-time target must be a positive number of seconds")
        if self.min_prefill_tokens <= 0:
            raise ValueError("min_prefill_tokens must be positive")

    @property
    def per_prompt_token_s(self) -> float:
        """What a prompt (or draft) token costs, the scale included."""
        return self.prefill_scale * self.costs.per_prefill_token_s

    @property
    def per_decode_s(self) -> float:
        """What a decode row costs at the recent mean context, before the scale."""
        costs = self.costs
        return costs.per_decode_s + costs.per_context_token_s * self.context_per_decode

    def predict_s(self, num_decodes: int, num_prefill_tokens: int) -> float:
        costs = self.costs
        return (
            costs.fixed_s
            + self.scale * self.per_decode_s * num_decodes
            + self.per_prompt_token_s * num_prefill_tokens
        )

    @property
    def max_decodes(self) -> int:
        """The most decodes one step holds within the (stretched) target with room left for
        prefill (at least one)."""
        return self.decodes_within(self.stretch)

    def decodes_within(self, stretch: float = 1.0) -> int:
        """The most decodes a step holds within the target stretched by ``stretch``, with room
        left for prefill (at least one)."""
        costs = self.costs
        room = (self.target_s * stretch - costs.fixed_s) * (1 - PREFILL_SHARE)
        return max(1, int(room / (self.scale * self.per_decode_s)))

    def stretch_to_prefill(self, num_tokens: int, seconds: float, num_decodes: int) -> float:
        """How far the target must stretch for steps of ``num_decodes`` decodes to compute
        ``num_tokens`` prompt tokens within ``seconds`` (the last step counted whole): 1 where
        the unstretched steps do, infinite where even prompts alone would not.

        A step of length ``S`` leaves ``S - rest`` beside its fixed part and decodes (``rest``)
        to prompt tokens at ``c`` seconds each, so the prompts get the fraction ``1 - rest / S``
        of the time; they need ``busy = num_tokens · c / seconds`` of it, which a step reaches at
        ``S = rest / (1 - busy)``. Unstretched, they get what the decodes leave of the target,
        and never less than ``PREFILL_SHARE`` of what is not fixed."""
        if num_tokens <= 0:
            return 1.0
        seconds -= self.target_s
        per_token = self.per_prompt_token_s
        if seconds <= 0:
            return math.inf
        busy = num_tokens * per_token / seconds
        if busy >= 1:
            return math.inf
        rest = self.predict_s(num_decodes, 0)
        given = max(self.target_s - rest, (self.target_s - self.costs.fixed_s) * PREFILL_SHARE)
        if given / max(self.target_s, rest + given) >= busy:
            return 1.0
        return max(1.0, rest / (1 - busy) / self.target_s)

    def prefill_budget(self, num_decodes: int) -> int:
        """Prefill (and draft) tokens that fit beside ``num_decodes`` decodes; at least
        ``min_prefill_tokens``, so that waiting work always moves on."""
        room = self.target_s * self.stretch - self.predict_s(num_decodes, 0)
        if room <= 0:
            return self.min_prefill_tokens
        per_token = self.per_prompt_token_s
        return max(self.min_prefill_tokens, int(room / per_token))

    def prefill_share(self) -> int:
        """Prefill (and draft) tokens in the share of the (stretched) target that full batches
        of decodes leave (``PREFILL_SHARE``); at least ``min_prefill_tokens``."""
        room = (self.target_s * self.stretch - self.costs.fixed_s) * PREFILL_SHARE
        per_token = self.per_prompt_token_s
        return max(self.min_prefill_tokens, int(room / per_token))

    def observe(
        self,
        num_decodes: int,
        num_prefill_tokens: int,
        seconds: float,
        num_context_tokens: int = 0,
    ) -> None:
        """Correct the scales by a step that ran ``num_decodes`` decodes (attending to
        ``num_context_tokens`` tokens in all) and ``num_prefill_tokens`` other tokens in
        ``seconds``, and the mean context by its decodes. The step's measured/modelled ratio of
        the rows' time moves each scale by the share of that time its rows were predicted to
        take."""
        if num_decodes + num_prefill_tokens <= 0 or not seconds > 0:
            return
        costs = self.costs
        if num_decodes:
            context = num_context_tokens / num_decodes
            self.context_per_decode += SCALE_SMOOTHING * (context - self.context_per_decode)
        decode_rows = self.scale * (
            costs.per_decode_s * num_decodes + costs.per_context_token_s * num_context_tokens
        )
        prefill_rows = self.per_prompt_token_s * num_prefill_tokens
        rows = decode_rows + prefill_rows
        ratio = (seconds - costs.fixed_s) / rows
        step = SCALE_SMOOTHING / rows
        self.scale = _moved(self.scale, ratio, step * decode_rows)
        self.prefill_scale = _moved(self.prefill_scale, ratio, step * prefill_rows)


def _moved(scale: float, ratio: float, rate: float) -> float:
    """``scale`` moved ``rate`` of the way to ``scale × ratio``, within the bounds."""
    wanted = min(max(scale * ratio, MIN_SCALE), MAX_SCALE)
    return scale + rate * (wanted - scale)
