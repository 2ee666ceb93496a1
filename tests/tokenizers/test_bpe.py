"""Byte-level BPE: the readable reference encoder and the tiktoken fast path give the same ids.

Tokenizers are trained in fixtures: one on the whole Shakespeare corpus (gpt4 pattern, 2048
ids), and one per pattern on a small mixed text (English, CJK, emoji, combining marks,
"\\r\\n", whitespace runs, long runs of one character) so that random text meets merges of
every kind of byte.
"""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tinylm.tokenizers import BPETokenizer, load_tokenizer, train_bpe

PATTERN_NAMES = ["gpt2", "gpt4", "none"]

MIXED_TEXT = [
    "To be, or not to be, that is the question:\r\nWhether 'tis nobler in the mind to suffer\r\n",
    "東京タワーは高い。東京の夜景はきれいです。中文分词很有意思，中文很有意思。",
    "emoji 😀😀 👍🏽👍🏽 👩‍👩‍👧 family 👩‍👩‍👧 again 😀 and café naïve résumé e\u0301e\u0301",
    "    indented code:\n\tif x == 1:\n\t\treturn   y  \n\n\n   trailing   \n",
    "numbers 1234567 3.14159 2024-06-01 and it's they're we'll I'VE DON'T\u00a0nbsp\u2028sep",
    "a" * 300 + " " + "^" * 300 + " " + "ab" * 100,
] * 3


@pytest.fixture(scope="module")
def shakespeare_tok(shakespeare_corpus) -> BPETokenizer:
    return train_bpe(shakespeare_corpus.texts(), 2048, "gpt4")


@pytest.fixture(scope="module")
def mixed_toks() -> dict[str, BPETokenizer]:
    return {name: train_bpe(MIXED_TEXT, 500, name, n_reserved=2, workers=1) for name in PATTERN_NAMES}


# Arbitrary Unicode, plus text built from pieces that stress the split patterns and the merges.
PIECES = [
    "\r\n", "\n\n", "  ", "\t", " ", "\u00a0", "\u2028", "😀", "👍🏽", "👩‍👩‍👧", "東京", "中文", "e\u0301",
    "'s", "'LL", "123456", "3.14", "aaaa", "^^^", "ab", " the", "To be", "<|eos|>", "<|bos|>", "\x00", "\ufffd",
]
# Characters assigned in Python's Unicode database (14.0 on 3.11): the reference splits with the
# `regex` module and the fast path with tiktoken's Rust regex, and their tables only differ on
# characters added to Unicode after that (see the note in tinylm/tokenizers/bpe.py).
assigned = st.characters(exclude_categories=("Cs", "Cn"))
texts = st.one_of(st.text(assigned), st.lists(st.sampled_from(PIECES), max_size=30).map("".join))


# ----- the reference encoder equals the fast path --------------------------------------------


@pytest.mark.slow
def test_reference_equals_fast_path_on_the_whole_shakespeare_corpus(shakespeare_tok, shakespeare_corpus):
    docs = list(shakespeare_corpus.texts())
    fast = shakespeare_tok.encode_batch(docs)
    assert [shakespeare_tok.encode(doc) for doc in docs] == fast
    assert [shakespeare_tok.encode_reference(doc) for doc in docs] == fast  # ~10 s: the reference is plain Python
    assert sum(map(len, fast)) < sum(map(len, docs)) / 2.5  # it really compresses: merges are used


@pytest.mark.parametrize("pattern", PATTERN_NAMES)
@settings(max_examples=150, deadline=None)
@given(text=texts)
def test_reference_equals_fast_path_on_random_text(mixed_toks, pattern, text):
    tok = mixed_toks[pattern]
    assert tok.encode_reference(text) == tok.encode(text)


@settings(max_examples=100, deadline=None)
@given(text=texts)
def test_reference_equals_fast_path_with_shakespeare_merges(shakespeare_tok, text):
    assert shakespeare_tok.encode_reference(text) == shakespeare_tok.encode(text)


# ----- round trips ---------------------------------------------------------------------------


@pytest.mark.parametrize("pattern", PATTERN_NAMES)
@settings(max_examples=150, deadline=None)
@given(text=texts)
def test_decode_inverts_encode(mixed_toks, pattern, text):
    tok = mixed_toks[pattern]
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.decode_bytes(ids) == text.encode("utf-8")


@pytest.mark.parametrize("text", ["a" * 100_000, "^" * 10**6], ids=["a*1e5", "^*1e6"])
@pytest.mark.parametrize("pattern", PATTERN_NAMES)
def test_long_runs_of_one_character_encode_in_bounded_time(mixed_toks, pattern, text):
    tok = mixed_toks[pattern]  # trained on runs of "a" and "^", so it has merges for them
    start = time.perf_counter()
    ids = tok.encode(text)
    assert len(ids) < len(text) / 4  # the run merges
    assert tok.decode(ids) == text
    assert tok.encode_reference(text) == ids
    assert time.perf_counter() - start < 30  # generous: the point is "not quadratic"


# ----- special tokens ------------------------------------------------------------------------


@pytest.mark.parametrize("encoder", ["encode", "encode_reference"])
def test_special_token_text_is_plain_text_unless_allowed(mixed_toks, encoder):
    tok = mixed_toks["gpt4"]
    encode = getattr(tok, encoder)
    text = "end of story.<|eos|>Next one"
    plain = encode(text)
    assert tok.eos_id not in plain and tok.decode(plain) == text
    expected = encode("end of story.") + [tok.eos_id] + encode("Next one")
    assert encode(text, allowed_special="all") == expected
    assert encode(text, allowed_special={"<|eos|>"}) == expected
    assert encode(text, allowed_special={"<|bos|>"}) == plain  # only the allowed ones count
    assert encode("<|reserved_1|>", allowed_special="all") == [tok.special_tokens["<|reserved_1|>"]]
    assert tok.decode(expected) == text


def test_both_encoders_agree_on_special_tokens(mixed_toks):
    tok = mixed_toks["gpt2"]
    text = "<|bos|>hello<|eos|><|pad|><|pad|> world<|eos|>"
    for allowed in [(), "all", {"<|eos|>"}, {"<|pad|>", "<|bos|>"}]:
        assert tok.encode_reference(text, allowed_special=allowed) == tok.encode(text, allowed_special=allowed)
    assert tok.encode_batch([text, "x"], allowed_special="all") == [
        tok.encode(text, allowed_special="all"),
        tok.encode("x", allowed_special="all"),
    ]


# ----- the vocabulary and saving -------------------------------------------------------------


def test_a_merge_token_is_the_concatenation_of_its_pair(shakespeare_tok):
    tok = shakespeare_tok
    assert tok.vocab_size == 2048 and len(tok.merges) == 2048 - 256 - 3
    for rank, (left, right) in enumerate(tok.merges):
        assert tok.token_bytes(256 + rank) == tok.token_bytes(left) + tok.token_bytes(right)
    assert len({tok.token_bytes(i) for i in range(tok.base_vocab_size)}) == tok.base_vocab_size
    assert tok.token_bytes(tok.encode(" the")[0]) == b" the"  # the commonest word is one token


@pytest.mark.parametrize("pattern", PATTERN_NAMES)
def test_save_and_load_give_identical_encodings(mixed_toks, tmp_path, pattern):
    tok = mixed_toks[pattern]
    loaded = load_tokenizer(tok.save(tmp_path / "tok.json"))
    assert isinstance(loaded, BPETokenizer)
    assert loaded.merges == tok.merges and loaded.pattern == tok.pattern
    assert loaded.special_tokens == tok.special_tokens and loaded.fingerprint() == tok.fingerprint()
    for text in MIXED_TEXT[:6]:
        assert loaded.encode(text) == tok.encode(text)
        assert loaded.encode_reference(text, allowed_special="all") == tok.encode(text, allowed_special="all")


def test_hand_trained_tokenizer_encodes_as_worked_out():
    # the merges of test_bpe_train's hand-worked example: aa=256 ab=257 aaab=258 ac=259
    # daaab=260 aaabdaaab=261 aaabdaaabac=262
    with pytest.warns(UserWarning, match="ran out of pairs"):
        tok = train_bpe(["aaabdaaabac"], 269, "none", workers=1)
    assert tok.encode("aaabdaaabac") == [262]
    assert tok.encode("aaa") == [256, 97]  # left to right: "aa" then "a"
    assert tok.encode("aab") == [256, 98]  # (a,a) has a lower rank than (a,b), so it goes first
    assert tok.encode("aaab") == [258]  # aa + ab
    assert tok.encode("dac") == [100, 259]
    for text in ["aaa", "aab", "aaaab", "dac", "baaabdaaab"]:
        assert tok.encode_reference(text) == tok.encode(text)
