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
            return compiler.compile_grammar(json_schema_ebnf('{"type": "object"}', strict=False))
        if spec.kind == "json_schema":  # only the declared properties are ever produced
            return compiler.compile_grammar(json_schema_ebnf(spec.value))
        if spec.kind == "regex":
            regex = xgrammar.Grammar.from_regex(spec.value)
            return compiler.compile_grammar(scalar_values(str(regex)))
        return compiler.compile_grammar(spec.ebnf())

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def json_schema_ebnf(schema: str, strict: bool = True) -> str:
    """The compact-JSON grammar of ``schema`` as EBNF, with strings kept to valid JSON."""
    grammar = xgrammar.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=strict)
    return scalar_values(str(grammar).replace(_BOUNDED_STRING_CHAR, _JSON_STRING_CHAR))


def scalar_values(ebnf: str) -> str:
    """``ebnf`` (as xgrammar prints it) with no character class matching a surrogate code point.

    xgrammar 0.2.8 matches U+D800..U+DFFF in a class like any other code point, as three bytes
    (ED A0..BF 80..BF) that are not UTF-8: on a byte-level vocabulary the output then holds them,
    they decode to three U+FFFD, and a string of at most n characters comes out longer. The
    printer writes U+0000..U+00FF as two-digit \\xHH, which its parser reads greedily (\\xefc
    would be U+0EFC): those are written back as fixed-width \\u00HH.
    """
    text = _ESCAPE.sub(_fixed_width, ebnf)
    out: list[str] = []
    i = 0
    while i < len(text):
        char = text[i]
        if char == '"':  # a literal: copied up to its closing quote
            end = i + 1
            while end < len(text) and text[end] != '"':
                end += 2 if text[end] == "\\" else 1
            out.append(text[i : end + 1])
            i = end + 1
        elif char == "[":
            end = i + 1
            while end < len(text) and text[end] != "]":
                end += 2 if text[end] == "\\" else 1
            out.append(_without_surrogates(text[i + 1 : end]))
            i = end + 1
        else:
            out.append(char)
            i += 1
    return "".join(out)


_CLASS_ITEM = re.compile(
    r"\\(?:u([0-9a-fA-F]{4})|U([0-9a-fA-F]{8})|x([0-9a-fA-F]+)|(.))|(.)", re.DOTALL
)
_SINGLE_ESCAPES = {"n": "\n", "r": "\r", "t": "\t", "f": "\f", "v": "\v", "0": "\0"}
_SURROGATES = (0xD800, 0xDFFF)


def _without_surrogates(body: str) -> str:
    """One character class's body rewritten as a class that leaves the surrogates out."""
    if body.startswith("^"):  # a negated class: the surrogates join what it excludes
        return f"[{body}\\uD800-\\uDFFF]"
    items = list(_CLASS_ITEM.finditer(body))
    points = [_code_point(m) for m in items]
    pieces = [m.group(0) for m in items]
    ranges: list[tuple[int, int]] = []
    spans: list[str] = []
    changed = False
    k = 0
    while k < len(points):
        if k + 2 < len(points) and pieces[k + 1] == "-":
            low, high, source = points[k], points[k + 2], "".join(pieces[k : k + 3])
            k += 3
        else:
            low, high, source = points[k], points[k], pieces[k]
            k += 1
        if high < _SURROGATES[0] or low > _SURROGATES[1]:
            spans.append(source)
            continue
        changed = True
        if low < _SURROGATES[0]:
            ranges.append((low, _SURROGATES[0] - 1))
        if high > _SURROGATES[1]:
            ranges.append((_SURROGATES[1] + 1, high))
    if not changed:
        return f"[{body}]"
    spans.extend(f"{_class_char(low)}-{_class_char(high)}" for low, high in ranges)
    return f"[{''.join(spans)}]" if spans else f"[{body}]"  # only surrogates: left to refuse


def _code_point(item: re.Match[str]) -> int:
    hex_digits = item.group(1) or item.group(2) or item.group(3)
    if hex_digits:
        return int(hex_digits, 16)
    escaped = item.group(4)
    if escaped is not None:
        return ord(_SINGLE_ESCAPES.get(escaped, escaped))
    return ord(item.group(5))


def _class_char(code_point: int) -> str:
    return f"\\U{code_point:08x}" if code_point > 0xFFFF else f"\\u{code_point:04x}"


def _fixed_width(match: re.Match[str]) -> str:
    escape = match.group(1)
    return "\\u00" + escape[1:] if len(escape) == 3 else match.group(0)
