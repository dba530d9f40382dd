"""Between Hugging Face tensor names and our fused layout (qkv_proj, gate_up_proj), both ways."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from engine.model.config import ModelConfig

_NORMS = ("input_layernorm", "post_attention_layernorm")


def hf_to_fused(
    config: ModelConfig,
    get: Callable[[str], torch.Tensor],
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> dict[str, torch.Tensor]:
    """Fetch HF-named tensors through ``get`` (raises KeyError if absent) and fuse them."""

    def fetch(name: str) -> torch.Tensor:
        return get(name).to(device=device, dtype=dtype)

    state: dict[str, torch.Tensor] = {
        "embed_tokens.weight": fetch("model.embed_tokens.weight"),
        "norm.weight": fetch("model.norm.weight"),
    }
    if not config.tie_word_embeddings:
        state["lm_head.weight"] = fetch("lm_head.weight")
    for i in range(config.num_layers):
        hf, ours = f"model.layers.{i}", f"layers.{i}"
        attn = f"{hf}.self_attn"
        state[f"{ours}.self_attn.qkv_proj.weight"] = torch.cat(
            [fetch(f"{attn}.{p}_proj.weight") for p in "qkv"]
        )
        if config.attention_bias:
            state[f"{ours}.self_attn.qkv_proj.bias"] = torch.cat(
                [fetch(f"{attn}.{p}_proj.bias") for p in "qkv"]
            )
        state[f"{ours}.self_attn.o_proj.weight"] = fetch(f"{attn}.o_proj.weight")
        state[f"{ours}.mlp.gate_up_proj.weight"] = torch.cat(
            [fetch(f"{hf}.mlp.gate_proj.weight"), fetch(f"{hf}.mlp.up_proj.weight")]
        )
        state[f"{ours}.mlp.down_proj.weight"] = fetch(f"{hf}.mlp.down_proj.weight")
        for norm in _NORMS:
            state[f"{ours}.{norm}.weight"] = fetch(f"{hf}.{norm}.weight")
    return state


def fused_to_hf(config: ModelConfig, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Split our fused tensors back into HF names (contiguous copies, ready for safetensors)."""
    out: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": state["embed_tokens.weight"],
        "model.norm.weight": state["norm.weight"],
    }
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = state["lm_head.weight"]
    sizes = [config.q_size, config.kv_size, config.kv_size]
    for i in range(config.num_layers):
        hf, ours = f"model.layers.{i}", f"layers.{i}"
        qkv = torch.split(state[f"{ours}.self_attn.qkv_proj.weight"], sizes)
        for p, t in zip("qkv", qkv, strict=True):
            out[f"{hf}.self_attn.{p}_proj.weight"] = t
        if config.attention_bias:
            bias = torch.split(state[f"{ours}.self_attn.qkv_proj.bias"], sizes)
            for p, t in zip("qkv", bias, strict=True):
                out[f"{hf}.self_attn.{p}_proj.bias"] = t
        out[f"{hf}.self_attn.o_proj.weight"] = state[f"{ours}.self_attn.o_proj.weight"]
        gate, up = torch.split(state[f"{ours}.mlp.gate_up_proj.weight"], config.intermediate_size)
        out[f"{hf}.mlp.gate_proj.weight"] = gate
        out[f"{hf}.mlp.up_proj.weight"] = up
        out[f"{hf}.mlp.down_proj.weight"] = state[f"{ours}.mlp.down_proj.weight"]
        for norm in _NORMS:
            out[f"{hf}.{norm}.weight"] = state[f"{ours}.{norm}.weight"]
    return {name: t.detach().contiguous() for name, t in out.items()}
