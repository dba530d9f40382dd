"""A closed-loop client inside the process: keeps N requests in an LLMEngine and times each token.

Prompts come from a ``PromptSource``; the driver also tracks what an unbounded page-granular
cache would have reused, in the order the engine saw the prompts and answers.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from bench.metrics import RequestRecord
from bench.workloads import Prompt, page_keys
from engine.llm_engine import LLMEngine
from engine.outputs import GenerateRequest
from engine.sampling_params import SamplingParams


class PromptSource(Protocol):
    def next_prompt(self) -> Prompt | None:
        """A prompt ready to send now, or None (none left, or all wait for an answer)."""

    def finished(self, prompt: Prompt, answer: Sequence[int]) -> None:
        """The answer of ``prompt`` arrived (token ids)."""

    @property
    def exhausted(self) -> bool: ...


@dataclass(slots=True)
class ListSource:
    """Prompts sent in list order, independent of answers."""

    prompts: list[Prompt]
    _next: int = 0

    def next_prompt(self) -> Prompt | None:
        if self._next >= len(self.prompts):
            return None
        self._next += 1
        return self.prompts[self._next - 1]

    def finished(self, prompt: Prompt, answer: Sequence[int]) -> None:
        return None

    @property
    def exhausted(self) -> bool:
        return self._next >= len(self.prompts)


@dataclass(slots=True)
class DriveResult:
    records: list[RequestRecord] = field(default_factory=list)
    ideal_cached_tokens: int = 0
    seconds: float = 0.0


@dataclass(slots=True)
class _Live:
    prompt: Prompt
    record: RequestRecord
    answer: list[int] = field(default_factory=list)


def drive(
    engine: LLMEngine, source: PromptSource, concurrency: int, page_size: int, tag: str
) -> DriveResult:
    """Run until the source is exhausted and every request has finished."""
    result = DriveResult()
    live: dict[str, _Live] = {}
    seen: set[object] = set()
    count = 0
    start = time.perf_counter()
    while True:
        while len(live) < concurrency:
            prompt = source.next_prompt()
            if prompt is None:
                break
            keys = page_keys(prompt.tenant, prompt.token_ids, page_size)
            usable = (len(prompt.token_ids) - 1) // page_size
            hit = 0
            while hit < usable and keys[hit] in seen:
                hit += 1
            result.ideal_cached_tokens += hit * page_size
            seen.update(keys)
            request_id = f"{tag}-{count}"
            count += 1
            params = SamplingParams(max_tokens=prompt.max_tokens, temperature=0.0, ignore_eos=True)
            record = RequestRecord(prompt.tenant, time.perf_counter())
            engine.add_request(
                GenerateRequest(request_id, list(prompt.token_ids), params, prompt.tenant)
            )
            live[request_id] = _Live(prompt, record)
        if not live:
            if source.exhausted:
                break
            raise RuntimeError("the prompt source stalled with nothing in flight")
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            entry = live.get(out.request_id)
            if entry is None:
                continue
            entry.record.token_times.extend([now] * len(out.token_ids))
            entry.answer.extend(out.token_ids)
            if out.finished:
                del live[out.request_id]
                record = entry.record
                record.done_at = now
                record.prompt_tokens = out.num_prompt_tokens
                record.cached_tokens = out.num_cached_tokens
                record.completion_tokens = out.num_output_tokens
                record.error = out.error
                result.records.append(record)
                # Everything but the last sampled token had its KV computed.
                computed = [*entry.prompt.token_ids, *entry.answer[:-1]]
                seen.update(page_keys(entry.prompt.tenant, computed, page_size))
                source.finished(entry.prompt, entry.answer)
    result.seconds = time.perf_counter() - start
    return result
