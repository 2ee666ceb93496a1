"""Hostile text through the BPE encoders: whitespace runs of a million characters, lone surrogates.

tiktoken's split engine gives up on about a million whitespace characters before a non-space (a
Rust panic, which Python sees as a BaseException), so tinylm splits text holding a long
whitespace run itself and merges the long chunks with numpy (`merge_long_chunk`). These tests
pin that path to the reference encoder: with the threshold lowered to a few characters, so
random short text exercises every cut, and at full size on the inputs that used to panic.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tinylm.errors import TinyLMError
from tinylm.tokenizers import BPETokenizer, CharTokenizer, WordTokenizer, train_bpe
from tinylm.tokenizers.bpe import _tiktoken_call, merge_long_chunk

# Text with indentation, blank lines, tabs, CRLF, ideographic and no-break spaces, so the trained
# merges include many whitespace tokens (runs of 2, 4, 8 spaces, tab runs, "\n\n"...).
WHITESPACE_TEXT = [
    "def f(x):\n    if x:\n        return  x\n\n\n\treturn\t\ty\r\n\r\n",
    "東京\u3000\u3000タワー\u3000は高い。\u00a0\u00a0nbsp  two  spaces   three    four        eight\n",
    "a" * 200 + " " * 64 + "." * 100 + "\t" * 32 + "\n" * 16 + " \t" * 20,
] * 4

PATTERNS = ["gpt2", "gpt4", "none", r"\s+|\w+|[^\s\w]+"]  # the built-in ones and one of the user's own


@pytest.fixture(scope="module")
def toks() -> dict[str, BPETokenizer]:
    return {p: train_bpe(WHITESPACE_TEXT, 340, p, workers=1) for p in PATTERNS}


def lowered(tok: BPETokenizer, long_run: int) -> BPETokenizer:
    """The same tokenizer, taking the long-run path for any whitespace run of ``long_run`` characters."""
    low = BPETokenizer(tok.merges, pattern=tok.pattern)
    low.long_run = long_run
    return low


RUNS = [" ", "\t", "\n", "\r\n", "\u3000", "\u00a0", "\u2028", " \t", "x", "ab", "東", ".", "1", "😀", " def"]
run_texts = st.lists(
    st.tuples(st.sampled_from(RUNS), st.sampled_from([1, 2, 3, 4, 5, 7, 8, 16, 33])), min_size=1, max_size=10
).map(lambda parts: "".join(unit * n for unit, n in parts))


@pytest.mark.parametrize("pattern", PATTERNS)
@settings(max_examples=150, deadline=None)
@given(text=run_texts, long_run=st.sampled_from([2, 3, 4, 6]))
def test_the_long_run_path_gives_the_reference_ids(toks, pattern, text, long_run):
    tok = toks[pattern]
    expected = tok.encode_reference(text)
    assert tok.encode_ordinary(text) == expected  # tiktoken, whole
    low = lowered(tok, long_run)
    assert low.encode_ordinary(text) == expected  # split by regex, long chunks merged by numpy
    assert low.encode(text, allowed_special="all") == tok.encode(text, allowed_special="all")
    assert low.encode_batch([text, "plain"]) == [expected, tok.encode_ordinary("plain")]


@settings(max_examples=200, deadline=None)
@given(chunk=st.lists(st.tuples(st.sampled_from([" ", "\t", "\n", "\u3000", "a", " \t"]),
                                st.integers(1, 40)), min_size=1, max_size=6)
       .map(lambda parts: "".join(u * n for u, n in parts)))
def test_vectorised_merge_equals_tiktoken_and_the_reference(toks, chunk):
    tok = toks["none"]  # one chunk is the whole text
    data = chunk.encode("utf-8")
    ids = merge_long_chunk(data, tok.vocab, tok._token_ids)
    assert ids is not None
    assert ids == tok.tiktoken_encoding._core_bpe.encode_single_piece(data) == tok._merge_chunk(list(data))


@pytest.mark.parametrize("unit", [" ", "\t", "\u3000"])
def test_a_million_whitespace_characters_encode_as_the_reference_does(toks, unit):
    tok = toks["gpt4"]
    text = "word" + unit * 1_000_000 + "x end"
    # the inputs the issue reported: tiktoken alone panics on them
    with pytest.raises(TinyLMError, match="tiktoken failed"):
        _tiktoken_call(tok.tiktoken_encoding.encode_ordinary, text)
    ids = tok.encode_ordinary(text)
    assert ids == tok.encode_reference(text)
    assert tok.decode(ids) == text
    assert tok.encode(text, allowed_special="all") == ids


def test_lone_surrogates_encode_the_same_way_in_every_encoder(toks):
    text = "a\ud800b \ud83d\ude00 c\udfff"  # a lone high, a pair (an emoji in two halves), a lone low
    clean = "a\ufffdb \U0001f600 c\ufffd"
    for tok in toks.values():
        assert tok.encode_ordinary(text) == tok.encode_reference(text) == tok.encode_ordinary(clean)
    for tok in (CharTokenizer.train([clean], unknown="bytes"), WordTokenizer.train([clean], 270, unknown="bytes")):
        assert tok.encode_ordinary(text) == tok.encode_ordinary(clean)
        assert tok.decode(tok.encode_ordinary(text)) == clean


@settings(max_examples=300, deadline=None)
@given(text=run_texts, long_run=st.integers(2, 40))
def test_long_runs_are_found_wherever_they_are(toks, text, long_run):
    # the check samples every long_run-th character; it must still see every run that long
    import regex

    assert lowered(toks["gpt4"], long_run)._has_long_run(text) == bool(regex.search(r"\s{%d}" % long_run, text))
