"""Incremental detokenization: UTF-8 split over tokens, stop strings, stop ids, EOS, length."""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.detokenizer import IncrementalDetokenizer
from engine.sampling_params import SamplingParams

EOS = 300


class ByteTokenizer:
    """Token i < 256 is byte i; decoding replaces broken UTF-8 like real tokenizers do."""

    def decode(self, token_ids: Sequence[int]) -> str:
        data = bytes(t for t in token_ids if t < 256)
        return data.decode("utf-8", errors="replace")


def encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def run(text_ids: list[int], params: SamplingParams) -> tuple[list[str], str | None]:
    detok = IncrementalDetokenizer(ByteTokenizer(), params, encode("prompt"), [EOS])
    deltas: list[str] = []
    for n, token in enumerate(text_ids, start=1):
        step = detok.update(token, n)
        deltas.append(step.text)
        if step.finish_reason is not None:
            return deltas, step.finish_reason
    return deltas, None


@settings(max_examples=60, deadline=None)
@given(st.text(min_size=1, max_size=40))
def test_deltas_join_to_the_text_and_are_never_broken(text: str) -> None:
    ids = encode(text)
    deltas, reason = run(ids, SamplingParams(max_tokens=len(ids)))
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas) or "\ufffd" in text
    assert reason == "length"


def test_multibyte_character_is_emitted_once_complete() -> None:
    ids = encode("é€")  # 2 + 3 bytes
    deltas, _ = run(ids, SamplingParams(max_tokens=100))
    assert deltas == ["", "é", "", "", "€"]


@settings(max_examples=60, deadline=None)
@given(
    before=st.text(alphabet="abc xyz", max_size=12),
    after=st.text(alphabet="abc xyz", max_size=12),
    stop=st.text(alphabet="xyz#", min_size=1, max_size=4),
)
def test_stop_string_cuts_the_text_whatever_the_token_boundaries(
    before: str, after: str, stop: str
) -> None:
    text = before + stop + after
    deltas, reason = run(encode(text), SamplingParams(max_tokens=1000, stop=(stop,)))
    assert reason == "stop"
    assert "".join(deltas) == text[: text.index(stop)]


def test_text_that_may_become_a_stop_string_is_held_back() -> None:
    deltas, reason = run(encode("ab##c"), SamplingParams(max_tokens=1000, stop=("###",)))
    assert reason is None
    assert deltas == ["a", "b", "", "", "##c"]


def test_include_stop_str_keeps_it_and_earliest_stop_wins() -> None:
    params = SamplingParams(max_tokens=100, stop=("END", "D!"), include_stop_str_in_output=True)
    deltas, reason = run(encode("xEND!"), params)
    assert reason == "stop"
    assert "".join(deltas) == "xEND"


def test_eos_and_stop_token_ids_finish_without_their_text() -> None:
    deltas, reason = run([*encode("hi"), EOS, *encode("more")], SamplingParams(max_tokens=100))
    assert (reason, "".join(deltas)) == ("stop", "hi")
    stop_id = ord("!")
    deltas, reason = run(encode("hey!x"), SamplingParams(max_tokens=100, stop_token_ids=(stop_id,)))
    assert (reason, "".join(deltas)) == ("stop", "hey")


def test_ignore_eos_keeps_generating_until_length() -> None:
    deltas, reason = run(
        [*encode("a"), EOS, *encode("b")], SamplingParams(max_tokens=3, ignore_eos=True)
    )
    assert (reason, "".join(deltas)) == ("length", "ab")


def test_length_flushes_held_back_text() -> None:
    deltas, reason = run(encode("ab#"), SamplingParams(max_tokens=3, stop=("##",)))
    assert (reason, "".join(deltas)) == ("length", "ab#")
