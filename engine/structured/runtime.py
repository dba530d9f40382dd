"""What the engine holds for structured output: the compiler and the step's mask filler."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import torch

from engine.errors import InvalidRequestError
from engine.scheduler import ScheduledSeq
from engine.structured.compiler import GrammarCompiler
from engine.structured.masks import MaskFiller, StepMask
from engine.structured.spec import GrammarSpec
from engine.structured.state import GrammarState


class StructuredOutput:
    """Built by the engine on its first constrained request (xgrammar threads start here)."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, stop_token_ids: tuple[int, ...]) -> None:
        self.compiler = GrammarCompiler(hf_tokenizer, vocab_size, stop_token_ids)
        self.masks = MaskFiller(self.compiler.vocab_width)

    def state_for(self, spec: GrammarSpec, ignore_eos: bool) -> GrammarState:
        """A new request's grammar state; its grammar compiles in the background."""
        if ignore_eos:
            raise InvalidRequestError(
                "ignore_eos cannot be combined with structured output: a complete output ends",
                "ignore_eos",
            )
        return GrammarState(self.compiler.compile(spec), self.compiler)

    def start(self, sampled: list[ScheduledSeq]) -> Future[StepMask] | None:
        return self.masks.start(sampled)

    @staticmethod
    def apply(logits: torch.Tensor, pending: Future[StepMask] | None) -> None:
        if pending is not None:
            MaskFiller.apply(logits, pending.result())

    def close(self) -> None:
        self.compiler.close()
        self.masks.close()
