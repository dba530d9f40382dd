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


# The shape of a model built from its class's default config: only sizes are set (and the
# class's default token ids that would lie past the tiny vocabulary are dropped).
DEFAULT_SHAPE: dict[str, Any] = {
    "vocab_size": 260,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "initializer_range": 0.15,
}
# Per architecture: the config class, and its default head size where that is not
# hidden_size / num_attention_heads (a size too).
DEFAULT_CLASSES: dict[str, tuple[type[PretrainedConfig], dict[str, Any]]] = {
    "llama": (LlamaConfig, {}),
    "mistral": (MistralConfig, {}),
    "qwen2": (Qwen2Config, {}),
    "qwen3": (Qwen3Config, {"head_dim": 16}),
    "phi3": (Phi3Config, {}),
    "gemma2": (Gemma2Config, {"head_dim": 16}),
    "gemma3": (Gemma3TextConfig, {"head_dim": 16}),
}
TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def default_config(arch: str) -> PretrainedConfig:
    """``arch``'s config as its transformers class writes it by default, at a tiny size."""
    cls, head = DEFAULT_CLASSES[arch]
    config = cls(**DEFAULT_SHAPE, **head)
    for name in TOKEN_IDS:
        value = getattr(config, name, None)
        if isinstance(value, int) and value >= DEFAULT_SHAPE["vocab_size"]:
            setattr(config, name, None)  # Phi-3's 32000: no row of a tiny vocabulary
    return config


def tiny_config(arch: str, **overrides: Any) -> PretrainedConfig:
    cls, extra = ARCHITECTURES[arch]
    return cls(**{**TINY_CONFIG, "initializer_range": 0.15, **extra, **overrides})


def make_tiny_model(
    arch: str, dir: Path, seed: int = 0, *, config: PretrainedConfig | None = None, **overrides: Any
) -> Path:
    """Write config.json, model.safetensors and a byte-level tokenizer of a random tiny model
    (of ``config``, else ``tiny_config(arch, **overrides)``).

    Norms and biases are drawn at random too (transformers starts them at 1, 0 or 0), so the
    comparison notices which goes where; Gemma's norms scale by 1 + weight.
    """
    torch.manual_seed(seed)
    model: PreTrainedModel = AutoModelForCausalLM.from_config(
        config if config is not None else tiny_config(arch, **overrides)
    )
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
