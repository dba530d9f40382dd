"""Compiled grammars for one engine: xgrammar's compiler on a worker thread, cached by spec.

Compiling runs off the engine's step: a request's grammar is compiled while its prompt is
prefilled, and only its first sampled token waits for it. The vocabulary information is built
for the model's logit width, which may exceed the tokenizer's (padding rows are never allowed).
"""

from __future__ import annotations

import re
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import xgrammar

from engine.structured.closing import ByteTable
from engine.structured.spec import GrammarSpec

MAX_CACHED = 256  # compiled grammars kept (least recently used dropped first)
# xgrammar 0.2.8 lets a string with minLength/maxLength hold raw control characters, which JSON
# forbids (json.loads refuses them): such strings take the character class of its other strings.
_BOUNDED_STRING_CHAR = '[^\\"\\\\\\r\\n]'
_ESCAPE = re.compile(r"\\(x[0-9a-fA-F]{2}|.)", re.DOTALL)  # one escape: \xHH or \ and a char
_JSON_STRING_CHAR = '[^\\0-\\x1f\\"\\\\]'


class GrammarCompiler:
    """Compiles ``GrammarSpec``s for one tokenizer and logit width; thread-safe ``compile``."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, stop_token_ids: tuple[int, ...]) -> None:
        self.vocab_size = vocab_size  # the model's logit width: the bitmask's width
        self._hf = hf_tokenizer
        self._stop_token_ids = list(stop_token_ids)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        self._compiled: OrderedDict[GrammarSpec, Future[xgrammar.CompiledGrammar]] = OrderedDict()
        self._compiler: xgrammar.GrammarCompiler | None = None
        self.table: ByteTable | None = None  # set with the first compile, before it is done

    @property
    def vocab_width(self) -> int:
        """Tokens the bitmask covers: the larger of the logit width and the tokenizer's size;
        tokens past the logit width can never be sampled and are cut when the mask applies."""
        return max(self.vocab_size, len(self._hf))

    def compile(self, spec: GrammarSpec) -> Future[xgrammar.CompiledGrammar]:
        """The compiled grammar of ``spec``, now or later (a failed compile raises from
        ``result()``). Called from the engine thread only."""
        future = self._compiled.get(spec)
        if future is not None:
            self._compiled.move_to_end(spec)
            return future
        future = self._executor.submit(self._compile, spec)
        self._compiled[spec] = future
        if len(self._compiled) > MAX_CACHED:
            self._compiled.popitem(last=False)
        return future

    def _compile(self, spec: GrammarSpec) -> xgrammar.CompiledGrammar:
        compiler = self._compiler
        if compiler is None:
            info = xgrammar.TokenizerInfo.from_huggingface(
                self._hf, vocab_size=self.vocab_width, stop_token_ids=self._stop_token_ids
            )
            hf = self._hf
            self.table = ByteTable(
                info, lambda text: list(hf.encode(text, add_special_tokens=False))
            )
            compiler = self._compiler = xgrammar.GrammarCompiler(info, max_threads=1)
        # Compact JSON (no free whitespace): fewer tokens, and no runs of blank lines.
        if spec.kind == "json":  # any object, with any properties
            return compiler.compile_json_schema(
                '{"type": "object"}', any_whitespace=False, strict_mode=False
            )
        if spec.kind == "json_schema":  # only the declared properties are ever produced
            return compiler.compile_grammar(json_schema_ebnf(spec.value))
        if spec.kind == "regex":
            return compiler.compile_regex(spec.value)
        return compiler.compile_grammar(spec.ebnf())

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def json_schema_ebnf(schema: str) -> str:
    """The compact-JSON grammar of ``schema`` as EBNF, with strings kept to valid JSON."""
    grammar = xgrammar.Grammar.from_json_schema(schema, any_whitespace=False)
    text = str(grammar).replace(_BOUNDED_STRING_CHAR, _JSON_STRING_CHAR)
    # The printer writes U+0000..U+00FF as two-digit \xHH, which its parser reads greedily
    # (\xefc would be U+0EFC): written back as fixed-width \u00HH instead.
    return _ESCAPE.sub(_fixed_width, text)


def _fixed_width(match: re.Match[str]) -> str:
    escape = match.group(1)
    return "\\u00" + escape[1:] if len(escape) == 3 else match.group(0)
