"""Rebuild a byte-level BPE tokenizer from GGUF metadata (``tokenizer.ggml.*``), offline.

Byte-level (``gpt2``) vocabularies are built directly with the ``tokenizers`` library; the
pre-tokenizer follows ``tokenizer.ggml.pre``. Other vocabularies go through transformers.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as RawTokenizer
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

# Token types in GGUF: 3 = control, 4 = user defined (both are atomic special tokens).
_SPECIAL_TYPES = (3, 4)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
_DIGIT_SPLITTING = ("smollm", "starcoder", "refact", "deepseek-coder")


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGIT_SPLITTING:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in ("llama-bpe", "llama3", "qwen2"):
        split = _QWEN2_SPLIT if pre == "qwen2" else _LLAMA3_SPLIT
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    return byte_level


def build_gguf_tokenizer(meta: Mapping[str, Any], gguf_path: Path) -> PreTrainedTokenizerBase:
    """A transformers fast tokenizer equivalent to the one the GGUF file was converted from."""
    if meta.get("tokenizer.ggml.model") != "gpt2":
        tok: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True
        )
        return tok
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    vocab = {t: i for i, t in enumerate(tokens)}
    raw = RawTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    pre = str(meta.get("tokenizer.ggml.pre", "default"))
    if pre == "qwen2":
        raw.normalizer = normalizers.NFC()
    raw.pre_tokenizer = _pre_tokenizer(pre)
    raw.decoder = decoders.ByteLevel()
    specials = [
        AddedToken(t, special=True, normalized=False)
        for t, kind in zip(tokens, types, strict=True)
        if kind in _SPECIAL_TYPES
    ]
    raw.add_special_tokens(specials)

    def token(key: str) -> str | None:
        idx = meta.get(f"tokenizer.ggml.{key}_token_id")
        return None if idx is None else tokens[int(idx)]

    hf = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=raw,
        bos_token=token("bos"),
        eos_token=token("eos"),
        unk_token=token("unknown"),
        pad_token=token("padding"),
        add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        add_eos_token=False,
        clean_up_tokenization_spaces=False,
    )
    template = meta.get("tokenizer.chat_template")
    if template:
        hf.chat_template = str(template)
    return hf
