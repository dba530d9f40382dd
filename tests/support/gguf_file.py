"""Write a Hugging Face Llama directory as a GGUF file the way llama.cpp's converter lays it out."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize
from safetensors.numpy import load_file

from engine.model.gguf_loader import permute_rows

_GGUF_NAMES = {
    "input_layernorm.weight": "attn_norm",
    "self_attn.q_proj.weight": "attn_q",
    "self_attn.k_proj.weight": "attn_k",
    "self_attn.v_proj.weight": "attn_v",
    "self_attn.o_proj.weight": "attn_output",
    "post_attention_layernorm.weight": "ffn_norm",
    "mlp.gate_proj.weight": "ffn_gate",
    "mlp.up_proj.weight": "ffn_up",
    "mlp.down_proj.weight": "ffn_down",
}


def gguf_name(hf_name: str) -> str:
    globals_ = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf_name in globals_:
        return globals_[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{_GGUF_NAMES[rest]}.weight"


def add_array(
    writer: GGUFWriter, name: str, array: np.ndarray, qtype: GGMLQuantizationType
) -> None:
    """Add ``array`` (float32, [rows, cols]) stored as ``qtype``."""
    if qtype == GGMLQuantizationType.F32:
        writer.add_tensor(name, array.astype(np.float32))
    elif qtype == GGMLQuantizationType.F16:
        writer.add_tensor(name, array.astype(np.float16))
    else:
        writer.add_tensor(name, quantize(array.astype(np.float32), qtype), raw_dtype=qtype)


def hf_dir_to_gguf(
    hf_dir: Path,
    out: Path,
    qtype_for: Callable[[str], GGMLQuantizationType] = lambda _: GGMLQuantizationType.F32,
) -> Path:
    """Config, tokenizer (byte-level BPE) and weights of ``hf_dir`` as a llama GGUF file."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    writer = GGUFWriter(str(out), "llama")
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(float(cfg.get("rope_parameters", cfg).get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_vocab_size(cfg["vocab_size"])
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
    writer.add_chat_template((hf_dir / "chat_template.jinja").read_text())
    for hf_name, weight in load_file(str(hf_dir / "model.safetensors")).items():
        array = weight
        if hf_name.endswith("q_proj.weight"):
            array = permute_rows(weight, heads)
        elif hf_name.endswith("k_proj.weight"):
            array = permute_rows(weight, kv_heads)
        qtype = GGMLQuantizationType.F32 if array.ndim == 1 else qtype_for(hf_name)
        add_array(writer, gguf_name(hf_name), array, qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
