"""Greedy logprobs equal transformers' log-softmax of the same positions (fp32, within 1e-3)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model.loader import load_model
from engine.outputs import GenerateRequest, TokenLogprob
from engine.sampling_params import SamplingParams
from tests.support.greedy import run_all

NUM_NEW = 8
TOP = 5


@pytest.mark.parametrize("speculative_tokens", [0, 4])
def test_greedy_logprobs_match_transformers(tiny_llama_dir: Path, speculative_tokens: int) -> None:
    loaded = load_model(str(tiny_llama_dir), dtype=torch.float32)
    hf = LlamaForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()  # type: ignore[no-untyped-call]
    config = EngineConfig(
        dtype="float32", num_pages=64, max_num_batched_tokens=32, max_num_seqs=8,
        speculative_tokens=speculative_tokens,
    )  # fmt: skip
    engine = LLMEngine(loaded, config)
    # The second prompt repeats itself, so n-gram drafts are proposed and accepted for it.
    prompts = [[(7 * j + 3) % 256 for j in range(21)], [5, 6, 7, 8] * 10]
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True, logprobs=TOP)
    plain = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(GenerateRequest(f"lp{i}", prompt, params))
        engine.add_request(GenerateRequest(f"plain{i}", prompt, plain))
    outputs = run_all(engine)
    for i, prompt in enumerate(prompts):
        tokens = [t for o in outputs[f"lp{i}"] for t in o.token_ids]
        logprobs: list[TokenLogprob] = [lp for o in outputs[f"lp{i}"] for lp in o.logprobs or []]
        assert tokens == [t for o in outputs[f"plain{i}"] for t in o.token_ids]
        assert [lp.token_id for lp in logprobs] == tokens
        with torch.inference_mode():
            logits = hf(torch.tensor([prompt + tokens])).logits[0].float()
        expected = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)  # [NUM_NEW, vocab]
        for step, entry in enumerate(logprobs):
            assert entry.logprob == pytest.approx(float(expected[step, tokens[step]]), abs=1e-3)
            top = expected[step].topk(TOP)
            assert [t for t, _ in entry.top] == top.indices.tolist()
            assert [v for _, v in entry.top] == pytest.approx(top.values.tolist(), abs=1e-3)
            assert entry.top[0][0] == tokens[step]  # greedy: the chosen token is the best one
    if speculative_tokens:
        assert engine.stats.num_accepted_draft_tokens > 0
