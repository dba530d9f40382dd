"""The transformers reference on the same weights: static-batch greedy ``generate`` timings."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaForCausalLM


def load_reference(model_dir: Path, dtype: torch.dtype) -> Any:
    """transformers' LlamaForCausalLM from an exported Hugging Face directory, in eval mode."""
    model: Any = LlamaForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
    return model.eval()


def _generate(model: Any, prompts: Sequence[Sequence[int]], new_tokens: int) -> float:
    """Seconds for one static batch to produce exactly ``new_tokens`` tokens each (greedy)."""
    input_ids = torch.tensor([list(p) for p in prompts], dtype=torch.long)
    mask = torch.ones_like(input_ids)
    eos = model.generation_config.eos_token_id
    pad = eos[0] if isinstance(eos, list) else eos
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=pad,
        )
    elapsed = time.perf_counter() - start
    if out.shape[1] != input_ids.shape[1] + new_tokens:
        raise RuntimeError("transformers stopped early despite min_new_tokens")
    return elapsed


def reference_prefill(model: Any, prompts: Sequence[Sequence[int]]) -> float:
    """Prompt tokens per second, one prompt at a time, one new token each."""
    elapsed = sum(_generate(model, [p], 1) for p in prompts)
    return sum(len(p) for p in prompts) / elapsed


def reference_decode(model: Any, prompts: Sequence[Sequence[int]], new_tokens: int) -> float:
    """Decode tokens per second of one static batch: (time for n+1 tokens − time for 1)."""
    first = _generate(model, prompts, 1)
    total = _generate(model, prompts, new_tokens + 1)
    return len(prompts) * new_tokens / max(total - first, 1e-9)


def warm_up(model: Any, prompt: Sequence[int]) -> None:
    _generate(model, [prompt], 2)
