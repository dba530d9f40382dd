"""The tokenizer the engine and the gateway share: encode, decode, chat template, stop ids."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from engine.errors import InvalidRequestError

# End-of-turn tokens a chat template may close each message with.
_END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")


class Tokenizer:
    """Wraps a transformers fast tokenizer; ``hf`` stays available for incremental decoding."""

    def __init__(self, hf: PreTrainedTokenizerBase, extra_eos_ids: Iterable[int] = ()) -> None:
        self.hf = hf
        ids: list[int] = [int(i) for i in extra_eos_ids]
        if hf.eos_token_id is not None:
            ids.append(int(hf.eos_token_id))
        template = hf.chat_template if isinstance(hf.chat_template, str) else ""
        vocab = hf.get_vocab()
        for token in _END_OF_TURN:
            if token in template and token in vocab:
                ids.append(int(vocab[token]))
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(ids))

    @classmethod
    def from_dir(cls, path: Path, extra_eos_ids: Iterable[int] = ()) -> Tokenizer:
        """Load tokenizer files from a Hugging Face directory, never touching the network."""
        if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer.model")):
            raise FileNotFoundError(f"no tokenizer.json or tokenizer.model in {path}")
        hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        return cls(hf, extra_eos_ids)

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    @property
    def bos_token_id(self) -> int | None:
        bos = self.hf.bos_token_id
        return None if bos is None else int(bos)

    @property
    def chat_template(self) -> str | None:
        template = self.hf.chat_template
        return template if isinstance(template, str) else None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids: list[int] = self.hf.encode(text, add_special_tokens=add_special_tokens)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        text = self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return text if isinstance(text, str) else "".join(text)

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The chat template rendered as text (special tokens included literally).

        A template that refuses the messages (``raise_exception``, or any error while rendering
        them) raises InvalidRequestError: what it renders is the client's, so the fault is too.
        """
        if self.chat_template is None:
            raise InvalidRequestError("this model has no chat template", param="messages")
        try:
            text = self.hf.apply_chat_template(
                messages,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
                tools=None if tools is None else list[Any](tools),
            )
        except Exception as exc:
            raise InvalidRequestError(
                f"The model's chat template refused these messages: {exc}", param="messages"
            ) from exc
        return str(text)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """Token ids of the rendered chat (``tools`` for a template that shows them); the
        template itself places any BOS token."""
        return self.encode(self.render_chat(messages, add_generation_prompt, tools))
