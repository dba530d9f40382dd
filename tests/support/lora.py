"""Random LoRA adapters written by PEFT itself, and PEFT's merged model as the reference."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import LlamaForCausalLM

from tests.support.tiny_llama import load_reference


def make_adapter(
    base_dir: Path,
    out_dir: Path,
    seed: int,
    rank: int,
    alpha: float,
    targets: list[str],
    rslora: bool = False,
) -> Path:
    """A PEFT LoRA adapter of the model at ``base_dir`` with random A and B (PEFT's default
    init leaves B zero, which would change nothing), saved as adapter_config.json and
    adapter_model.safetensors."""
    torch.manual_seed(seed)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=targets,
        use_rslora=rslora,
        init_lora_weights=False,
        lora_dropout=0.0,
    )
    with warnings.catch_warnings():  # transformers' deprecation notice on a PEFT call
        warnings.simplefilter("ignore", FutureWarning)
        peft_model = get_peft_model(load_reference(base_dir), config)
    with torch.no_grad():  # larger deltas than PEFT's random init, so greedy tokens change
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.2)
    peft_model.save_pretrained(out_dir)
    return out_dir


def merged_reference(base_dir: Path, adapter_dir: Path) -> LlamaForCausalLM:
    """transformers' model with PEFT's adapter merged into its weights, float32, eval mode."""
    with warnings.catch_warnings():  # transformers' deprecation notice on a PEFT call
        warnings.simplefilter("ignore", FutureWarning)
        peft_model = PeftModel.from_pretrained(load_reference(base_dir), adapter_dir)
    merged = peft_model.merge_and_unload()
    merged.eval()
    assert isinstance(merged, LlamaForCausalLM)
    return merged
