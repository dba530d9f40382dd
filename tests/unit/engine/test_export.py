"""Export to a Hugging Face directory: transformers reloads it and computes the same logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoTokenizer
from transformers import LlamaForCausalLM as HFLlama

from engine.attention.torch_backend import TorchAttentionBackend
from engine.model.export import export_hf
from engine.model.loader import LoadedModel, load_model
from tests.support.paged import PagedRunner, PagedSeq
from tests.support.tiny_llama import load_reference, make_tiny_llama


def next_token_logits(loaded: LoadedModel, tokens: list[int]) -> torch.Tensor:  # [vocab]
    pages = -(-len(tokens) // 16)
    runner = PagedRunner(loaded.model, TorchAttentionBackend(), num_pages=pages, page_size=16)
    seq = PagedSeq(tokens, list(range(pages))[::-1])
    return runner.step([seq], [len(tokens)])[0]


def hf_next_token_logits(hf: HFLlama, tokens: list[int]) -> torch.Tensor:  # [vocab]
    with torch.no_grad():
        out: torch.Tensor = hf(torch.tensor([tokens])).logits[0, -1].float()
    return out


@pytest.mark.parametrize("tied", [False, True])
def test_tiny_export_reloads_in_transformers(tmp_path: Path, tied: bool) -> None:
    src = make_tiny_llama(tmp_path / "src", seed=5, tie_word_embeddings=tied)
    loaded = load_model(str(src), dtype=torch.float32)
    out = tmp_path / "out"
    export_hf(loaded, out)
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert ("lm_head.weight" in names) is not tied
    assert "model.layers.1.self_attn.q_proj.weight" in names
    hf = load_reference(out, torch.float32)
    tokens = list(range(30, 60))
    torch.testing.assert_close(
        hf_next_token_logits(hf, tokens), next_token_logits(loaded, tokens), atol=1e-4, rtol=0
    )
    tok = AutoTokenizer.from_pretrained(str(out))
    assert tok.encode("abc <|im_end|>") == loaded.tokenizer.encode("abc <|im_end|>")
    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"]


def test_export_keeps_the_loaded_dtype(tiny_llama_dir: Path, tmp_path: Path) -> None:
    loaded = load_model(str(tiny_llama_dir), dtype=torch.bfloat16)
    export_hf(loaded, tmp_path / "out")
    with safe_open(str(tmp_path / "out" / "model.safetensors"), framework="pt") as f:
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["dtype"] == "bfloat16"


@pytest.mark.slow
def test_default_model_export_matches_transformers(
    default_model_fp32: LoadedModel, tmp_path: Path
) -> None:
    loaded = default_model_fp32
    export_hf(loaded, tmp_path / "smol")
    hf = load_reference(tmp_path / "smol", torch.float32)
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, 12 + 30 ="]
    for prompt in prompts:
        tokens = loaded.tokenizer.encode(prompt)
        ours = next_token_logits(loaded, tokens)
        theirs = hf_next_token_logits(hf, tokens)
        torch.testing.assert_close(ours, theirs, atol=2e-3, rtol=0)
    # Greedy continuation of a chat prompt: 16 tokens identical.
    prompt_ids = loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi! Who are you?"}]
    )
    ours_ids = list(prompt_ids)
    runner = PagedRunner(loaded.model, TorchAttentionBackend(), num_pages=8, page_size=16)
    seq = PagedSeq(ours_ids, [3, 1, 4, 0, 5, 2, 7, 6])
    runner.step([seq], [len(prompt_ids)])
    for _ in range(16):
        ours_ids.append(int(seq.logits[-1].argmax()))
        runner.step([seq], [1])
    theirs_ids = list(prompt_ids)
    for _ in range(16):
        theirs_ids.append(int(hf_next_token_logits(hf, theirs_ids).argmax()))
    assert ours_ids == theirs_ids
    assert loaded.tokenizer.decode(ours_ids[len(prompt_ids) :]).strip()
