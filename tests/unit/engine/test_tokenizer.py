"""The tokenizer wrapper: round trips, special tokens, chat template and stop ids."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.model.loader import LoadedModel
from engine.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tiny_tok(tiny_llama_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_llama_dir)


def test_round_trip_and_atomic_specials(tiny_tok: Tokenizer) -> None:
    text = "Grüße, 世界! tabs\tand\nnewlines"
    assert tiny_tok.decode(tiny_tok.encode(text)) == text
    ids = tiny_tok.encode("a<|im_end|>b")
    im_end = tiny_tok.hf.convert_tokens_to_ids("<|im_end|>")
    assert ids == [*tiny_tok.encode("a"), im_end, *tiny_tok.encode("b")]
    assert tiny_tok.decode(ids) == "ab"
    assert tiny_tok.decode(ids, skip_special_tokens=False) == "a<|im_end|>b"


def test_chat_template_and_stop_ids(tiny_tok: Tokenizer) -> None:
    messages = [{"role": "user", "content": "hi"}]
    ids = tiny_tok.apply_chat_template(messages)
    rendered = tiny_tok.decode(ids, skip_special_tokens=False)
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    without = tiny_tok.apply_chat_template(messages, add_generation_prompt=False)
    assert ids[: len(without)] == without and len(without) < len(ids)
    assert tiny_tok.hf.convert_tokens_to_ids("<|im_end|>") in tiny_tok.eos_token_ids


def test_missing_tokenizer_files_raise(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        Tokenizer.from_dir(tmp_path)


@pytest.mark.slow
def test_default_model_tokenizer(default_model_fp32: LoadedModel) -> None:
    tok = default_model_fp32.tokenizer
    assert tok.vocab_size == default_model_fp32.config.vocab_size
    text = "Hello world! The year 2024 isn't over."
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    # SmolLM's pre-tokenizer splits digits one by one.
    assert [tok.decode([i]) for i in tok.encode("2024")] == ["2", "0", "2", "4"]
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}])
    rendered = tok.decode(prompt, skip_special_tokens=False)
    assert rendered.startswith("<|im_start|>system\n")
    assert rendered.endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    assert tok.hf.convert_tokens_to_ids("<|im_end|>") in tok.eos_token_ids
    assert default_model_fp32.config.eos_token_ids == tok.eos_token_ids
