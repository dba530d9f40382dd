"""A scripted engine for gateway tests: deterministic tokens per seed, optional per-token delay."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

from engine.outputs import GenerateRequest, RequestOutput
from engine.tokenizer import Tokenizer
from web.openai.generation import ModelRuntime
from web.settings import Settings
from web.tenancy.principal import InMemoryTenancy, InMemoryTenant

MODEL = "tiny-llama"
KEY_A = "sk-tenant-a"
KEY_B = "sk-tenant-b"
KEY_SUSPENDED = "sk-suspended"


@dataclass
class ScriptedEngine:
    """Emits printable byte tokens chosen by the request's seed, one output per token."""

    tokenizer: Tokenizer
    delay_s: float = 0.0
    aborted: list[str] = field(default_factory=list)
    requests: list[GenerateRequest] = field(default_factory=list)
    seen_prefixes: dict[str, set[tuple[int, ...]]] = field(default_factory=dict)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        self.requests.append(request)
        prompt = tuple(request.prompt_token_ids)
        seen = self.seen_prefixes.setdefault(request.tenant_id, set())
        cached = (len(prompt) // 16) * 16 if prompt in seen else 0
        seen.add(prompt)
        rng = random.Random(request.params.seed)
        text = ""
        ids: list[int] = []
        for step in range(request.params.max_tokens):
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            token = self.tokenizer.encode(chr(rng.randrange(97, 123)))[0]
            ids.append(token)
            full = self.tokenizer.decode(ids)
            stop = next((s for s in request.params.stop if s in full), None)
            done = stop is not None or step + 1 == request.params.max_tokens
            if stop is not None:
                full = full[: full.index(stop)]
            delta, text = full[len(text) :], full
            yield RequestOutput(
                request_id=request.request_id,
                token_ids=[token],
                text=delta,
                finished=done,
                finish_reason=("stop" if stop else "length") if done else None,
                num_prompt_tokens=len(prompt),
                num_cached_tokens=cached,
                num_output_tokens=len(ids),
            )
            if done:
                return

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def make_runtime(tiny_llama_dir: Path, delay_s: float = 0.0) -> tuple[ModelRuntime, ScriptedEngine]:
    tokenizer = Tokenizer.from_dir(tiny_llama_dir)
    engine = ScriptedEngine(tokenizer, delay_s)
    runtime = ModelRuntime(MODEL, engine, tokenizer, max_model_len=256)
    return runtime, engine


def make_tenancy() -> InMemoryTenancy:
    tenancy = InMemoryTenancy()
    tenancy.add_key(KEY_A, InMemoryTenant("tenant-a", max_prompt_tokens=200))
    tenancy.add_key(KEY_B, InMemoryTenant("tenant-b", max_concurrent_requests=0))
    tenancy.add_key(KEY_SUSPENDED, InMemoryTenant("tenant-s", suspended=True))
    return tenancy


def settings(**overrides: object) -> Settings:
    return Settings.load(overrides, environ={})
