"""Character- and word-level tokenizers: vocabularies, unknown-input policies, round trips."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tinylm.errors import TinyLMError
from tinylm.tokenizers import CharTokenizer, WordTokenizer, load_tokenizer
from tinylm.tokenizers.pieces import WORD_PATTERN

import regex

# Arbitrary Unicode, weighted towards the hard cases: emoji (4 UTF-8 bytes, ZWJ sequences),
# CJK, combining marks, "\r\n" and whitespace runs.
hard_text = st.lists(
    st.one_of(
        st.characters(codec="utf-8"),
        st.sampled_from(["😀", "👩‍👩‍👧", "中", "文", "e\u0301", "\r\n", "  ", "\t", "ß", "'s", "\u200d"]),
    ),
    max_size=40,
).map("".join)


def test_char_vocabulary_is_the_sorted_characters_of_the_text():
    tok = CharTokenizer.train("hello world")
    # id 0 is <unk>, then ' ', 'd', 'e', 'h', 'l', 'o', 'r', 'w' in code point order
    assert tok.pieces_list == [" ", "d", "e", "h", "l", "o", "r", "w"]
    assert tok.encode("hello") == [4, 3, 5, 5, 6]
    assert tok.base_vocab_size == 9
    assert tok.vocab_size == 9 + 3  # bos, eos, pad follow
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (9, 10, 11)


def test_char_unknown_policy_unk_and_bytes():
    unk = CharTokenizer.train("abc")
    assert unk.encode("abz") == [1, 2, 0]
    assert unk.decode(unk.encode("abz")) == "ab\ufffd"
    byte = CharTokenizer.train("abc", unknown="bytes")
    ids = byte.encode("a中")
    assert ids[0] == 0 and ids[1:] == [3 + b for b in "中".encode()]  # byte tokens follow a, b, c
    assert byte.decode(ids) == "a中"


@settings(max_examples=200, deadline=None)
@given(hard_text, hard_text)
def test_byte_fallback_round_trips_every_string(train, text):
    for tok in (CharTokenizer.train(train + "x", unknown="bytes"), WordTokenizer.train(train + "x", 300, unknown="bytes")):
        assert tok.decode(tok.encode(text)) == text


@settings(max_examples=200, deadline=None)
@given(hard_text)
def test_known_text_round_trips_with_unk_policy(text):
    char = CharTokenizer.train([text, "x"])
    assert char.decode(char.encode(text)) == text
    word = WordTokenizer.train([text, "x"], 10_000)
    assert 0 not in word.encode(text)  # every piece was seen in training
    assert word.decode(word.encode(text)) == text


@settings(max_examples=300, deadline=None)
@given(hard_text)
def test_word_pieces_concatenate_back_to_the_text(text):
    assert "".join(regex.findall(WORD_PATTERN, text)) == text


def test_word_split_keeps_contractions_and_whitespace():
    tok = WordTokenizer.train("x", 100)
    assert tok.split("I'll blush'd, to't!\n\n  x") == [
        "I'll", " ", "blush'd", ",", " ", "to't", "!", "\n\n  ", "x"
    ]


def test_word_training_keeps_most_frequent_with_ties_by_text():
    # counts: " " 5, "b" 2, "a" 2, "c" 1, "d" 1. With |V| = 7 = 1 (<unk>) + 3 specials + 3 words,
    # the words kept are " " (5), then the tie at 2 broken by text: "a" before "b".
    tok = WordTokenizer.train("b a b a c d", vocab_size=7)
    assert tok.pieces_list == [" ", "a", "b"]
    assert tok.encode("a c") == [2, 1, 0]
    assert tok.decode(tok.encode("a c")) == "a <unk>"


def test_word_vocab_too_small_is_a_clear_error():
    with pytest.raises(TinyLMError, match="at least 5"):
        WordTokenizer.train("a b c", vocab_size=4)


def test_empty_training_text_is_a_clear_error():
    with pytest.raises(TinyLMError, match="empty"):
        CharTokenizer.train("")
    with pytest.raises(TinyLMError, match="empty"):
        WordTokenizer.train(iter([]), 100)


def test_training_streams_documents():
    docs = ["to be ", "or not ", "to be"]
    assert WordTokenizer.train(iter(docs), 50).pieces_list == WordTokenizer.train("".join(docs), 50).pieces_list
    assert CharTokenizer.train(iter(docs)).pieces_list == CharTokenizer.train("".join(docs)).pieces_list


@pytest.mark.parametrize("kind", ["char", "word"])
@pytest.mark.parametrize("unknown", ["unk", "bytes"])
def test_save_load_round_trip(tmp_path, kind, unknown):
    text = "First Citizen:\nBefore we proceed any further, hear me speak. 中文 😀"
    cls = CharTokenizer if kind == "char" else WordTokenizer
    tok = cls.train(text, unknown=unknown, n_reserved=2) if kind == "char" else cls.train(text, 300, unknown=unknown, n_reserved=2)
    tok.save(tmp_path / "tok.json")
    back = load_tokenizer(tmp_path / "tok.json")
    assert type(back) is cls
    probe = text + " unseen 🙂"
    assert back.encode(probe) == tok.encode(probe)
    assert back.special_tokens == tok.special_tokens
    assert back.fingerprint() == tok.fingerprint()
