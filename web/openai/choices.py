"""The choices of an answer: the prompts a completion names, their echo, and the choices of a
non-streamed answer collected from the engine's outputs."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from engine.outputs import RequestOutput, TokenLogprob
from web.openai.fields import unsupported
from web.openai.generation import GenerationService, Job
from web.openai.schemas import CompletionRequest, check_n
from web.ops.errors import bad_request

MAX_PROMPTS = 32  # prompts of one completions request
MAX_CHOICES = 64  # prompts times n

Prompt = str | list[int]


def prompts_of(prompt: str | list[str | int | list[int]]) -> list[Prompt]:
    """OpenAI's four forms: a string, strings, token ids, or lists of token ids."""
    if isinstance(prompt, str):
        return [prompt]
    shape = "prompt must be a string, a list of strings, token ids, or lists of token ids"
    if not prompt:
        raise bad_request("prompt must not be empty", "prompt")
    if all(isinstance(p, int) for p in prompt):
        return [[p for p in prompt if isinstance(p, int)]]
    prompts: list[Prompt] = []
    kind = type(prompt[0])
    for item in prompt:
        if type(item) is not kind or isinstance(item, int):
            raise bad_request(shape, "prompt")
        prompts.append(item)
    if len(prompts) > MAX_PROMPTS:
        raise bad_request(f"prompt takes at most {MAX_PROMPTS} prompts", "prompt")
    return prompts


def check_completion_options(body: CompletionRequest) -> int:
    """``n`` once ``best_of``, ``echo`` and the batch size are checked."""
    n = check_n(body.n)
    if body.best_of is not None and body.best_of != n:
        raise unsupported("best_of must equal n: choices are not ranked on the server", "best_of")
    if body.echo and body.logprobs is not None:
        raise unsupported(
            "echo with logprobs needs prompt logprobs, which are not computed", "echo"
        )
    if len(prompts_of(body.prompt)) * n > MAX_CHOICES:
        raise bad_request(f"prompts times n must be at most {MAX_CHOICES}", "n")
    return n


async def prompt_token_ids(
    service: GenerationService, prompt: str | list[str | int | list[int]]
) -> list[list[int]]:
    """Each prompt's token ids (strings tokenized off the loop); empty or unknown ids are a 400."""
    vocab_size = getattr(service.runtime.tokenizer, "vocab_size", None)
    result = []
    for index, item in enumerate(prompts_of(prompt)):
        ids = await service.tokenize_text(item) if isinstance(item, str) else item
        param = "prompt" if isinstance(prompt, str) else f"prompt[{index}]"
        if not ids:
            raise bad_request("prompt must not be empty", param)
        if isinstance(vocab_size, int) and any(not 0 <= t < vocab_size for t in ids):
            raise bad_request(f"token ids must be in [0, {vocab_size})", param)
        result.append(ids)
    return result


async def echo_texts(service: GenerationService, job: Job) -> dict[int, str]:
    """Each choice's prompt as text, for ``echo``."""
    decode = service.runtime.tokenizer.decode
    texts: dict[int, str] = {}
    for choice in job.choices:
        texts[choice.index] = await asyncio.to_thread(decode, choice.prompt_token_ids)
    return texts


@dataclass(slots=True)
class Answer:
    index: int
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None
    parts: list[str] = field(default_factory=list)


async def collect(
    service: GenerationService, job: Job, first: RequestOutput, rest: AsyncIterator[RequestOutput]
) -> list[Answer]:
    """Every choice's whole text, finish reason and logprobs, once the usage is recorded."""
    answers = {c.index: Answer(c.index) for c in job.choices}
    wants_logprobs = {c.index for c in job.choices if c.params.logprobs is not None}
    for index in wants_logprobs:
        answers[index].logprobs = []

    def add(out: RequestOutput) -> None:
        answer = answers[job.choice_of(out).index]
        answer.parts.append(out.text)
        if answer.logprobs is not None and out.logprobs:
            answer.logprobs.extend(out.logprobs)
        if out.finished:
            answer.finish_reason = out.finish_reason

    add(first)
    if not job.done:
        async for out in rest:
            add(out)
    await service.wait_recorded(job)
    for answer in answers.values():
        answer.text = "".join(answer.parts)
    return [answers[index] for index in sorted(answers)]
