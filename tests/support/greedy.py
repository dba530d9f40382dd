"""Greedy generation through the engine and through transformers, for token-identity tests."""

from __future__ import annotations

import torch
from transformers import LlamaForCausalLM

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model.loader import LoadedModel
from engine.outputs import GenerateRequest, RequestOutput
from engine.sampling_params import SamplingParams
from radix_cache.radix_prefix_cache import RadixPrefixCache


def run_all(engine: LLMEngine) -> dict[str, list[RequestOutput]]:
    """Step ``engine`` until nothing is unfinished (at most 10,000 steps); outputs by request."""
    outputs: dict[str, list[RequestOutput]] = {}
    for _ in range(10_000):
        if not engine.has_unfinished:
            break
        for output in engine.step():
            outputs.setdefault(output.request_id, []).append(output)
    assert not engine.has_unfinished
    return outputs


def run_greedy(
    engine: LLMEngine, prompts: list[list[int]], num_new: int, tag: str = "r", tenant: str = "t"
) -> tuple[list[list[int]], list[RequestOutput]]:
    """Run prompts to completion on ``engine``; the generated ids and each request's last output."""
    params = SamplingParams(max_tokens=num_new, temperature=0.0, ignore_eos=True)
    ids = [f"{tag}{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.add_request(GenerateRequest(rid, prompt, params, tenant_id=tenant))
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    last: dict[str, RequestOutput] = {}
    while engine.has_unfinished:
        for output in engine.step():
            tokens[output.request_id] += output.token_ids
            last[output.request_id] = output
    return [tokens[rid] for rid in ids], [last[rid] for rid in ids]


def engine_greedy(
    loaded: LoadedModel,
    prompts: list[list[int]],
    num_new: int,
    prefix_cache: bool = False,
    **config: int,
) -> tuple[list[list[int]], int]:
    """Greedy ids from a fresh float32 engine, and how many preemptions it needed."""
    factory = RadixPrefixCache if prefix_cache else None
    engine = LLMEngine(
        loaded,
        EngineConfig(dtype="float32", **config),  # type: ignore[arg-type]
        prefix_cache_factory=factory,
    )
    got, _ = run_greedy(engine, prompts, num_new)
    assert engine.cache.pool.num_free_pages + _cached_pages(engine) == engine.num_pages
    return got, engine.stats.num_preemptions


def _cached_pages(engine: LLMEngine) -> int:
    return sum(ns.resident_pages for ns in engine.cache.stats().values())


def hf_greedy(model: LlamaForCausalLM, prompts: list[list[int]], num_new: int) -> list[list[int]]:
    """Greedy decoding with transformers' own KV cache, never stopping at EOS (like ignore_eos)."""
    results = []
    with torch.inference_mode():
        for prompt in prompts:
            out = model(torch.tensor([prompt]), use_cache=True)
            tokens: list[int] = []
            for _ in range(num_new):
                token = int(out.logits[0, -1].argmax())
                tokens.append(token)
                out = model(
                    torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True
                )
            results.append(tokens)
    return results
