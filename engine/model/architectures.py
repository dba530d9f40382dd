"""What each supported architecture changes in the one decoder (``llama.py``): a table of
differences, and how a Hugging Face config's per-layer attention windows are read."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

# How a config without ``layer_types`` places its sliding-window layers.
WindowRule = Literal["all", "from_max_window_layers", "even_layers", "pattern"]


@dataclass(frozen=True, slots=True)
class ArchSpec:
    """One architecture's departures from Llama (every default is Llama's)."""

    hf_class: str  # the transformers class named in an exported config.json
    qkv_bias: bool = False  # Q, K and V projections always carry biases (Qwen2)
    qk_norm: bool = False  # an RMSNorm over each head of Q and of K, before RoPE (Qwen3, Gemma 3)
    sandwich_norms: bool = False  # RMSNorms after attention and after the MLP too (Gemma 2, 3)
    norm_offset: float = 0.0  # RMSNorms scale by (norm_offset + weight) (Gemma: 1)
    embed_scale: bool = False  # embeddings times sqrt(hidden_size) (Gemma)
    fused_hf_weights: bool = False  # the checkpoint holds qkv_proj and gate_up_proj fused (Phi-3)
    window_rule: WindowRule = "all"  # which layers a ``sliding_window`` applies to
    local_rope: bool = False  # sliding layers rotate with a RoPE base of their own (Gemma 3)
    gguf_permuted_qk: bool = False  # llama.cpp's converter interleaves Q/K rows (llama arch)
    gguf_norm_offset_added: bool = False  # llama.cpp's converter stored norm_offset + weight
    default_activation: str = "silu"


ARCHITECTURES: Mapping[str, ArchSpec] = {
    "llama": ArchSpec("LlamaForCausalLM", gguf_permuted_qk=True),
    "mistral": ArchSpec("MistralForCausalLM", gguf_permuted_qk=True),
    "qwen2": ArchSpec("Qwen2ForCausalLM", qkv_bias=True, window_rule="from_max_window_layers"),
    "qwen3": ArchSpec("Qwen3ForCausalLM", qk_norm=True, window_rule="from_max_window_layers"),
    "phi3": ArchSpec("Phi3ForCausalLM", fused_hf_weights=True),
    "gemma2": ArchSpec(
        "Gemma2ForCausalLM",
        sandwich_norms=True,
        norm_offset=1.0,
        embed_scale=True,
        window_rule="even_layers",
        gguf_norm_offset_added=True,
        default_activation="gelu_pytorch_tanh",
    ),
    # Gemma 3's text model: Gemma 2's layer less soft-capping (unless a config sets it), plus
    # Q/K norms (also ``1 + weight``), five sliding layers to one global
    # (``sliding_window_pattern``), and a RoPE base of its own on the sliding layers.
    "gemma3_text": ArchSpec(
        "Gemma3ForCausalLM",
        qk_norm=True,
        sandwich_norms=True,
        norm_offset=1.0,
        embed_scale=True,
        window_rule="pattern",
        local_rope=True,
        gguf_norm_offset_added=True,
        default_activation="gelu_pytorch_tanh",
    ),
}
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
# Config keys that change the computation in ways the decoder does not implement, with the
# value that means "not used" (a config holding anything else is refused by name).
_UNSUPPORTED_KEYS: Mapping[str, Any] = {
    "mlp_bias": False,
    "partial_rotary_factor": 1.0,
    "use_bidirectional_attention": False,  # Gemma 3's embedding variants
}


def refuse_unsupported(cfg: Mapping[str, Any], model_type: str) -> None:
    """Raise ValueError naming a setting of ``cfg`` the decoder would silently ignore."""
    for key, neutral in _UNSUPPORTED_KEYS.items():
        value = cfg.get(key)
        if value not in (None, neutral):
            raise ValueError(f"{model_type}: {key}={value!r} is not supported")
    if not ARCHITECTURES[model_type].qkv_bias and cfg.get("attention_bias"):
        # attention_bias also puts a bias on o_proj, which the decoder does not have.
        raise ValueError(f"{model_type}: attention_bias=True (an o_proj bias) is not supported")


def layer_windows(cfg: Mapping[str, Any], spec: ArchSpec, num_layers: int) -> tuple[int, ...]:
    """Per layer, the keys a query sees (itself included) under a sliding window, 0 for the
    whole history; empty when no layer slides. transformers 5 writes ``layer_types``; older
    configs imply them (``use_sliding_window`` and ``max_window_layers`` for Qwen)."""
    window = cfg.get("sliding_window")
    if spec.window_rule == "from_max_window_layers" and not cfg.get("use_sliding_window"):
        window = None  # as transformers reads it: no window unless use_sliding_window
    if not window:
        return ()
    types = cfg.get("layer_types")
    if types is not None:
        if len(types) != num_layers:
            raise ValueError(f"layer_types lists {len(types)} layers, the model has {num_layers}")
        unknown = set(types) - {"sliding_attention", "full_attention"}
        if unknown:
            raise ValueError(f"unsupported layer types {sorted(unknown)}")
        sliding = [t == "sliding_attention" for t in types]
    elif spec.window_rule == "from_max_window_layers":
        first = int(cfg.get("max_window_layers", num_layers))
        sliding = [i >= first for i in range(num_layers)]
    elif spec.window_rule == "even_layers":
        sliding = [i % 2 == 0 for i in range(num_layers)]
    elif spec.window_rule == "pattern":  # every n-th layer global, the others sliding
        pattern = int(cfg.get("sliding_window_pattern", 6))
        sliding = [(i + 1) % pattern != 0 for i in range(num_layers)]
    else:
        sliding = [True] * num_layers
    if not any(sliding):
        return ()
    return tuple(int(window) if s else 0 for s in sliding)
