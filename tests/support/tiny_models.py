"""Tiny random-weight models of each supported architecture, written by transformers itself as
Hugging Face directories (2 layers, hidden 64), loadable fully offline."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen3Config,
)

from tests.support.tiny_llama import TINY_CONFIG, byte_level_tokenizer

WINDOW = 12  # a sliding window shorter than the test prompts, not a multiple of the page size
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,  # small, so the tiny model's frequencies all scale
}
GEMMA2: dict[str, Any] = {
    "head_dim": 16,
    "query_pre_attn_scalar": 16,
    "sliding_window": WINDOW,
    "attn_logit_softcapping": 5.0,
    "final_logit_softcapping": 3.0,
    "tie_word_embeddings": True,
    "pad_token_id": 0,
}
GEMMA3: dict[str, Any] = {
    "head_dim": 16,
    "query_pre_attn_scalar": 16,
    "sliding_window": WINDOW,
    "num_hidden_layers": 6,  # five sliding layers, then a global one (GGUF files imply that)
    "rope_parameters": {  # as Gemma 3 4B's: the global layers' RoPE scaled, the sliding ones' not
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
    },
    "tie_word_embeddings": True,
    "pad_token_id": 0,
}
# Per architecture: its transformers config class and what sets it apart from TINY_CONFIG.
ARCHITECTURES: dict[str, tuple[type[PretrainedConfig], dict[str, Any]]] = {
    "llama": (LlamaConfig, {}),
    "llama3": (LlamaConfig, {"rope_parameters": LLAMA3_ROPE}),
    "mistral": (MistralConfig, {"sliding_window": WINDOW}),
    "qwen2": (Qwen2Config, {}),
    "qwen2_window": (
        Qwen2Config,
        {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
    ),
    "qwen3": (Qwen3Config, {"head_dim": 16}),
    "phi3": (Phi3Config, {"pad_token_id": 0, "sliding_window": WINDOW}),  # as Phi-3-mini-4k
    "gemma2": (Gemma2Config, GEMMA2),
    # A query scale apart from head_dim (as Gemma 2 27B's), which GGUF files do not carry.
    "gemma2_scaled": (Gemma2Config, {**GEMMA2, "query_pre_attn_scalar": 24}),
    "gemma3": (Gemma3TextConfig, GEMMA3),
}


def tiny_config(arch: str, **overrides: Any) -> PretrainedConfig:
    cls, extra = ARCHITECTURES[arch]
    return cls(**{**TINY_CONFIG, "initializer_range": 0.15, **extra, **overrides})


def make_tiny_model(arch: str, dir: Path, seed: int = 0, **overrides: Any) -> Path:
    """Write config.json, model.safetensors and a byte-level tokenizer of a random tiny model.

    Norms and biases are drawn at random too (transformers starts them at 1, 0 or 0), so the
    comparison notices which goes where; Gemma's norms scale by 1 + weight.
    """
    torch.manual_seed(seed)
    model: PreTrainedModel = AutoModelForCausalLM.from_config(tiny_config(arch, **overrides))
    model.eval()  # type: ignore[no-untyped-call]
    gemma = arch.startswith("gemma")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(-0.5, 0.5) if gemma else param.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.5)
    dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dir, safe_serialization=True)
    byte_level_tokenizer().save_pretrained(dir)
    return dir


def load_reference(model_dir: Path) -> PreTrainedModel:
    """transformers' own model class for the directory, float32, eval mode."""
    model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()  # type: ignore[no-untyped-call]
    return model
