"""Write a Hugging Face directory of any supported architecture as a GGUF file the way llama.cpp's
converter lays it out, with the ``gguf`` package's own tensor names and nothing of our loader:
Q/K rows interleaved for ``llama``, Llama 3's RoPE scaling as a ``rope_freqs`` tensor, Gemma's
norms (Q/K norms too) with their 1 added."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter
from safetensors.numpy import load_file

from tests.support.gguf_file import add_array

# (GGUF name, the directory's float32 weight [rows, cols]) -> the tensor's raw blocks (uint8
# [rows, bytes of a row]) and their type, or None for the default.
RawMatrix = Callable[[str, np.ndarray], tuple[np.ndarray, GGMLQuantizationType] | None]

_ARCHS = {
    "llama": gguf.MODEL_ARCH.LLAMA,
    "qwen2": gguf.MODEL_ARCH.QWEN2,
    "qwen3": gguf.MODEL_ARCH.QWEN3,
    "phi3": gguf.MODEL_ARCH.PHI3,
    "gemma2": gguf.MODEL_ARCH.GEMMA2,
    "gemma3_text": gguf.MODEL_ARCH.GEMMA3,
}


def interleave_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute`` of Q/K rows (rotate-half halves -> interleaved)."""
    rows = weight.shape[0]
    return (
        weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def llama3_rope_factors(rope: dict[str, Any], head_dim: int) -> np.ndarray:
    """llama.cpp's ``rope_freqs`` for Llama 3's scaling (divisors of each inverse frequency)."""
    base, factor = float(rope["rope_theta"]), float(rope["factor"])
    low, high = float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
    old = float(rope["original_max_position_embeddings"])
    factors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * base ** (i / head_dim)
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def _write_tokenizer(writer: GGUFWriter, hf_dir: Path, cfg: dict[str, Any]) -> None:
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab: dict[str, int] = dict(tok["model"]["vocab"])
    specials = {t["content"]: t["id"] for t in tok["added_tokens"]}
    tokens = sorted({**vocab, **specials}.items(), key=lambda kv: kv[1])
    pad = [f"<pad{i}>" for i in range(len(tokens), cfg["vocab_size"])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([t for t, _ in tokens] + pad)
    writer.add_token_types([3 if t in specials else 1 for t, _ in tokens] + [3] * len(pad))
    writer.add_token_merges(
        [" ".join(m) if isinstance(m, list) else m for m in tok["model"]["merges"]]
    )
    writer.add_bos_token_id(cfg["bos_token_id"])
    writer.add_eos_token_id(cfg["eos_token_id"])
    template = hf_dir / "chat_template.jinja"
    if template.is_file():
        writer.add_chat_template(template.read_text())


def arch_dir_to_gguf(
    hf_dir: Path,
    out: Path,
    qtype: GGMLQuantizationType = GGMLQuantizationType.F32,
    raw_matrix: RawMatrix | None = None,
) -> Path:
    """The directory's config, tokenizer and weights (matrices as ``qtype``) as a GGUF file.
    ``raw_matrix`` may store a matrix as raw blocks of a type of its choosing instead."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    model_type = cfg["model_type"]
    arch_name = "llama" if model_type == "mistral" else model_type
    arch = _ARCHS[arch_name]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    rope = cfg.get("rope_parameters") or {"rope_theta": cfg.get("rope_theta", 10000.0)}
    # Gemma 3: the global layers' RoPE; llama.cpp fixes the sliding layers' base at 10,000.
    rope = rope.get("full_attention", rope)
    writer = GGUFWriter(str(out), gguf.MODEL_ARCH_NAMES[arch])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_vocab_size(cfg["vocab_size"])
    if cfg.get("sliding_window"):
        writer.add_sliding_window(cfg["sliding_window"])
    if cfg.get("attn_logit_softcapping"):
        writer.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
    if cfg.get("final_logit_softcapping"):
        writer.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    _write_tokenizer(writer, hf_dir, cfg)
    if rope.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(rope, head_dim))
    names = gguf.get_tensor_name_map(arch, cfg["num_hidden_layers"])
    for hf_name, weight in load_file(str(hf_dir / "model.safetensors")).items():
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise KeyError(f"no GGUF name for {hf_name}")
        array = weight.astype(np.float32)
        raw = raw_matrix(name, array) if raw_matrix is not None and array.ndim == 2 else None
        if raw is not None:
            writer.add_tensor(name, raw[0], raw_dtype=raw[1])
            continue
        if arch_name == "llama" and hf_name.endswith("q_proj.weight"):
            array = interleave_rows(array, heads)
        elif arch_name == "llama" and hf_name.endswith("k_proj.weight"):
            array = interleave_rows(array, kv_heads)
        elif arch_name.startswith("gemma") and hf_name.endswith("norm.weight"):
            array = array + 1
        add_array(writer, name, array, GGMLQuantizationType.F32 if array.ndim == 1 else qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
