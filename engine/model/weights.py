"""Between Hugging Face tensor names and our fused layout (qkv_proj, gate_up_proj), both ways,
for every architecture in ``architectures.py``."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from engine.model.config import ModelConfig


def layer_norms(config: ModelConfig) -> dict[str, str]:
    """Our norm of each layer -> its HF name. ``post_attention_layernorm`` is always the norm
    before the MLP (Gemma 2 calls that one ``pre_feedforward_layernorm``)."""
    if config.spec.sandwich_norms:
        return {
            "input_layernorm": "input_layernorm",
            "attn_out_norm": "post_attention_layernorm",
            "post_attention_layernorm": "pre_feedforward_layernorm",
            "mlp_out_norm": "post_feedforward_layernorm",
        }
    return {
        "input_layernorm": "input_layernorm",
        "post_attention_layernorm": "post_attention_layernorm",
    }


def hf_to_fused(
    config: ModelConfig,
    get: Callable[[str], torch.Tensor],
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    norm_offset: float | None = None,
) -> dict[str, torch.Tensor]:
    """Fetch HF-named tensors through ``get`` (raises KeyError if absent) and fuse them.

    RMSNorm weights get ``norm_offset`` added (in float32, as Gemma's norm computes it), by
    default the architecture's: the model then scales by the weight alone.
    """
    spec = config.spec
    offset = spec.norm_offset if norm_offset is None else norm_offset

    def fetch(name: str) -> torch.Tensor:
        return get(name).to(device=device, dtype=dtype)

    def norm(name: str) -> torch.Tensor:
        return (get(name).float() + offset).to(device=device, dtype=dtype)

    state: dict[str, torch.Tensor] = {
        "embed_tokens.weight": fetch("model.embed_tokens.weight"),
        "norm.weight": norm("model.norm.weight"),
    }
    if not config.tie_word_embeddings:
        state["lm_head.weight"] = fetch("lm_head.weight")
    for i in range(config.num_layers):
        hf, ours = f"model.layers.{i}", f"layers.{i}"
        attn = f"{hf}.self_attn"
        if spec.fused_hf_weights:
            qkv = fetch(f"{attn}.qkv_proj.weight")
            gate_up = fetch(f"{hf}.mlp.gate_up_proj.weight")
        else:
            qkv = torch.cat([fetch(f"{attn}.{p}_proj.weight") for p in "qkv"])
            gate_up = torch.cat(
                [fetch(f"{hf}.mlp.gate_proj.weight"), fetch(f"{hf}.mlp.up_proj.weight")]
            )
        state[f"{ours}.self_attn.qkv_proj.weight"] = qkv
        if config.attention_bias:
            state[f"{ours}.self_attn.qkv_proj.bias"] = torch.cat(
                [fetch(f"{attn}.{p}_proj.bias") for p in "qkv"]
            )
        if spec.qk_norm:
            for p in "qk":
                state[f"{ours}.self_attn.{p}_norm.weight"] = norm(f"{attn}.{p}_norm.weight")
        state[f"{ours}.self_attn.o_proj.weight"] = fetch(f"{attn}.o_proj.weight")
        state[f"{ours}.mlp.gate_up_proj.weight"] = gate_up
        state[f"{ours}.mlp.down_proj.weight"] = fetch(f"{hf}.mlp.down_proj.weight")
        for our_norm, hf_norm in layer_norms(config).items():
            state[f"{ours}.{our_norm}.weight"] = norm(f"{hf}.{hf_norm}.weight")
    return state


def fused_to_hf(config: ModelConfig, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Split our fused tensors back into HF names (contiguous copies, ready for safetensors)."""
    spec = config.spec

    def norm(name: str) -> torch.Tensor:
        weight = state[name]
        return (weight.float() - spec.norm_offset).to(weight.dtype) if spec.norm_offset else weight

    out: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": state["embed_tokens.weight"],
        "model.norm.weight": norm("norm.weight"),
    }
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = state["lm_head.weight"]
    sizes = [config.q_size, config.kv_size, config.kv_size]
    for i in range(config.num_layers):
        hf, ours = f"model.layers.{i}", f"layers.{i}"
        qkv_weight = state[f"{ours}.self_attn.qkv_proj.weight"]
        gate_up = state[f"{ours}.mlp.gate_up_proj.weight"]
        if spec.fused_hf_weights:
            out[f"{hf}.self_attn.qkv_proj.weight"] = qkv_weight
            out[f"{hf}.mlp.gate_up_proj.weight"] = gate_up
        else:
            for p, t in zip("qkv", torch.split(qkv_weight, sizes), strict=True):
                out[f"{hf}.self_attn.{p}_proj.weight"] = t
            gate, up = torch.split(gate_up, config.intermediate_size)
            out[f"{hf}.mlp.gate_proj.weight"] = gate
            out[f"{hf}.mlp.up_proj.weight"] = up
        if config.attention_bias:
            bias = torch.split(state[f"{ours}.self_attn.qkv_proj.bias"], sizes)
            for p, t in zip("qkv", bias, strict=True):
                out[f"{hf}.self_attn.{p}_proj.bias"] = t
        if spec.qk_norm:
            for p in "qk":
                out[f"{hf}.self_attn.{p}_norm.weight"] = norm(f"{ours}.self_attn.{p}_norm.weight")
        out[f"{hf}.self_attn.o_proj.weight"] = state[f"{ours}.self_attn.o_proj.weight"]
        out[f"{hf}.mlp.down_proj.weight"] = state[f"{ours}.mlp.down_proj.weight"]
        for our_norm, hf_norm in layer_norms(config).items():
            out[f"{hf}.{hf_norm}.weight"] = norm(f"{ours}.{our_norm}.weight")
    return {name: t.detach().contiguous() for name, t in out.items()}
