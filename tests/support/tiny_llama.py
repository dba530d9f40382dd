"""A tiny random-weight Llama written as a Hugging Face directory, loadable fully offline."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as RawTokenizer
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TINY_CONFIG: dict[str, Any] = {
    "vocab_size": 260,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 257,
    "eos_token_id": 258,
}


def _byte_chars() -> list[str]:
    """The printable character byte-level BPE uses for each byte value 0..255."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars: list[str] = []
    extra = 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def byte_level_tokenizer() -> PreTrainedTokenizerFast:
    """256 byte tokens (ids 0..255, no merges) then the chat special tokens (256..258)."""
    vocab = {ch: b for b, ch in enumerate(_byte_chars())}
    raw = RawTokenizer(models.BPE(vocab=vocab, merges=[]))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=raw,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        clean_up_tokenization_spaces=False,
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def tiny_llama_config(**overrides: Any) -> LlamaConfig:
    return LlamaConfig(**{**TINY_CONFIG, **overrides})


def make_tiny_llama(dir: Path, seed: int = 0, **config_overrides: Any) -> Path:
    """Write config.json, model.safetensors and tokenizer files of a random tiny Llama."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config(**config_overrides))
    model.eval()  # type: ignore[no-untyped-call]
    with torch.no_grad():
        # Random norms make the check sensitive to which norm weight goes where.
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dir, safe_serialization=True)
    byte_level_tokenizer().save_pretrained(dir)
    return dir


def load_reference(model_dir: Path, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    """transformers' own LlamaForCausalLM on the same directory, in eval mode."""
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=dtype)
    model.eval()  # type: ignore[no-untyped-call]
    return model
