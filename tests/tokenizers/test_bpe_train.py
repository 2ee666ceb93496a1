"""BPE training: the incremental trainer against a hand-worked answer and a naive trainer.

The naive trainer below is the definition with nothing clever in it: before every merge it
counts every adjacent pair of every word again, takes the highest count (smallest pair on a
tie), skips a pair whose bytes are already a token, and rewrites every word. The fast trainer
(incremental counts, a lazy heap, parallel counting, streaming) must give the same merges.
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Iterator

import pytest
import regex
from hypothesis import given, settings
from hypothesis import strategies as st

from tinylm.errors import TinyLMError
from tinylm.tokenizers import bpe_train
from tinylm.tokenizers.bpe import PATTERNS
from tinylm.tokenizers.bpe_train import count_chunks, split_long_text, train_merges

N_SPECIAL = 3  # bos, eos, pad
a, b, c, d = 97, 98, 99, 100  # the bytes of "a", "b", "c", "d"


def naive_train(texts: list[str], n_merges: int, pattern: str) -> list[tuple[int, int]]:
    """Slow and obviously correct: recount all pairs before each merge."""
    chunk_counts = Counter(chunk for text in texts for chunk in regex.findall(pattern, text))
    words = [list(chunk.encode("utf-8")) for chunk in chunk_counts]
    freqs = list(chunk_counts.values())
    vocab = [bytes([i]) for i in range(256)]
    known = set(vocab)
    merges: list[tuple[int, int]] = []
    while len(merges) < n_merges:
        pair_counts: Counter[tuple[int, int]] = Counter()
        for word, freq in zip(words, freqs):
            for pair in zip(word, word[1:]):  # overlapping pairs each count: "aaa" has (a, a) twice
                pair_counts[pair] += freq
        candidates = [(-n, pair) for pair, n in pair_counts.items() if vocab[pair[0]] + vocab[pair[1]] not in known]
        if not candidates:
            break
        _, best = min(candidates)  # highest count, then smallest pair
        new_id = 256 + len(merges)
        merges.append(best)
        vocab.append(vocab[best[0]] + vocab[best[1]])
        known.add(vocab[-1])
        words = [replace_left_to_right(word, best, new_id) for word in words]
    return merges


def replace_left_to_right(word: list[int], pair: tuple[int, int], new_id: int) -> list[int]:
    out, i = [], 0
    while i < len(word):
        if word[i : i + 2] == list(pair):
            out.append(new_id)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return out


def vocab_for(n_merges: int, n_reserved: int = 0) -> int:
    return 256 + N_SPECIAL + n_reserved + n_merges


# ----- a known answer, worked by hand --------------------------------------------------------


def test_hand_worked_example_with_no_pre_tokenization():
    # "aaabdaaabac" with pattern "none" is one word. a=97 b=98 c=99 d=100.
    #   bytes: a a a b d a a a b a c
    #   pairs: (a,a) x4 (overlaps count: "aaa" holds two), (a,b) x2, (b,d) (d,a) (b,a) (a,c) x1
    # 1. (a,a) -> 256 "aa", left to right, so "aaa" becomes [256, a]:
    #      256 a b d 256 a b a c    pairs: (256,a) x2, (a,b) x2, the rest x1
    # 2. tie at 2 between (256,97) and (97,98): the smallest pair wins -> (a,b) -> 257 "ab"
    #    (not the pair that occurs first in the text, which is (256,a)):
    #      256 257 d 256 257 a c    pairs: (256,257) x2, the rest x1
    # 3. (256,257) -> 258 "aaab":  258 d 258 a c
    # 4. four pairs tie at 1: (258,100) (100,258) (258,97) (97,99); smallest (97,99) -> 259 "ac"
    #      258 d 258 259
    # 5. (100,258) < (258,100) < (258,259) -> 260 "daaab":  258 260 259
    # 6. (258,260) -> 261 "aaabdaaab":  261 259
    # 7. (261,259) -> 262, the whole text. No pair is left: training stops early, with a warning.
    expected = [(a, a), (a, b), (256, 257), (a, c), (d, 258), (258, 260), (261, 259)]
    with pytest.warns(UserWarning, match="ran out of pairs to merge after 7 of 10 merges"):
        merges = train_merges(["aaabdaaabac"], vocab_for(10), PATTERNS["none"], workers=1)
    assert merges == expected
    assert naive_train(["aaabdaaabac"], 10, PATTERNS["none"]) == expected


def test_merges_never_cross_a_chunk_boundary():
    # GPT-2 chunks "ab ab ab" as "ab", " ab", " ab": (a,b) x3, (" ",a) x2 and never (b," ").
    # 1. (a,b) -> 256.  2. (32,256) -> 257 " ab".  Then every chunk is one token.
    with pytest.warns(UserWarning, match="after 2 of"):
        merges = train_merges(["ab ab ab"], vocab_for(5), PATTERNS["gpt2"], workers=1)
    assert merges == [(a, b), (32, 256)]


def test_overlapping_runs():
    # "aaaaa": (a,a) x4 -> 256, left to right: [256, 256, a]. Now (256,256) and (256,a) tie at 1;
    # (256,97) is smaller -> 257, and the left-to-right scan replaces the later position:
    # [256, 257]. Last, (256,257) -> 258.
    with pytest.warns(UserWarning, match="after 3 of"):
        assert train_merges(["aaaaa"], vocab_for(4), PATTERNS["none"], workers=1) == [(a, a), (256, a), (256, 257)]
    # "ababab": (a,b) x3 beats (b,a) x2 -> 256: [256, 256, 256]. (256,256) counts 2 (overlapping)
    # -> 257, replacing left to right: [257, 256]. Last, (257,256) -> 258.
    with pytest.warns(UserWarning, match="after 3 of"):
        assert train_merges(["ababab"], vocab_for(4), PATTERNS["none"], workers=1) == [(a, b), (256, 256), (257, 256)]


def test_counts_are_weighted_by_how_often_a_chunk_occurs():
    # Three documents, each one chunk: "ab" once, "cd" twice. The distinct words are "ab" and
    # "cd", but (c,d) counts 2 and wins, although (a,b) is the smaller pair.
    merges = train_merges(["ab", "cd", "cd"], vocab_for(1), PATTERNS["none"], workers=1)
    assert merges == [(c, d)]


# ----- the fast trainer equals the naive one -------------------------------------------------

# A small alphabet makes repeated pairs, ties and overlapping runs ("aaaa", "abab") common.
small_texts = st.lists(
    st.text(alphabet=st.sampled_from(["a", "b", "c", " ", "\n", "'", "é", "😀", "1", "."]), max_size=40),
    min_size=1,
    max_size=4,
)


@settings(max_examples=300, deadline=None)
@given(
    texts=small_texts,
    pattern=st.sampled_from(sorted(PATTERNS)),
    n_merges=st.integers(0, 40),
    n_reserved=st.integers(0, 2),
)
def test_incremental_trainer_equals_naive_trainer(texts, pattern, n_merges, n_reserved):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = train_merges(texts, vocab_for(n_merges, n_reserved), PATTERNS[pattern], n_reserved=n_reserved, workers=1)
    assert got == naive_train(texts, n_merges, PATTERNS[pattern])
    # the warning comes exactly when training stopped short
    assert (len(got) < n_merges) == any("ran out of pairs" in str(w.message) for w in caught)


def test_incremental_trainer_equals_naive_trainer_on_shakespeare(shakespeare_corpus):
    # three short poems (25 KB) keep the naive trainer to a second or two
    docs = {doc.name: doc.text for doc in shakespeare_corpus.documents()}
    poems = [docs["lovers_complaint"], docs["passionate_pilgrim"], docs["phoenix_and_the_turtle"]]
    assert train_merges(poems, vocab_for(250), PATTERNS["gpt4"], workers=1) == naive_train(poems, 250, PATTERNS["gpt4"])
    one_chunk = [docs["phoenix_and_the_turtle"]]  # pattern "none": the whole poem is one word
    assert train_merges(one_chunk, vocab_for(300), PATTERNS["none"]) == naive_train(one_chunk, 300, PATTERNS["none"])


# ----- streaming and parallel counting -------------------------------------------------------


def test_a_generator_gives_the_same_merges_as_a_list():
    texts = [f"line {i}: the quick brown fox {'jumps ' * (i % 5)}over the lazy dog\n" for i in range(300)]

    def stream() -> Iterator[str]:
        yield from texts

    expected = train_merges(texts, vocab_for(60), PATTERNS["gpt4"], workers=1)
    assert train_merges(stream(), vocab_for(60), PATTERNS["gpt4"], workers=1) == expected
    # a single string is one document, not an iterable of characters
    assert train_merges("".join(texts), vocab_for(60), PATTERNS["gpt4"], workers=1) == train_merges(
        ["".join(texts)], vocab_for(60), PATTERNS["gpt4"], workers=1
    )


def test_two_workers_count_the_same_as_one(shakespeare_corpus, monkeypatch):
    texts = list(shakespeare_corpus.texts())[:4]
    one = count_chunks(texts, PATTERNS["gpt4"], workers=1)
    # small batches and no size threshold, so that this modest input really goes to a pool
    monkeypatch.setattr(bpe_train, "BATCH_CHARS", 50_000)
    monkeypatch.setattr(bpe_train, "POOL_MIN_CHARS", 1)
    pools = []
    real_pool = bpe_train.in_order

    def spy_pool(*args, **kwargs):
        pools.append(kwargs["workers"])
        return real_pool(*args, **kwargs)

    monkeypatch.setattr(bpe_train, "in_order", spy_pool)
    two = count_chunks(iter(texts), PATTERNS["gpt4"], workers=2)
    assert pools == [2]
    assert two == one
    assert train_merges(texts, vocab_for(100), PATTERNS["gpt4"], workers=2) == train_merges(
        texts, vocab_for(100), PATTERNS["gpt4"], workers=1
    )


def test_small_inputs_do_not_start_a_pool(monkeypatch):
    def no_pool(*args, **kwargs):
        raise AssertionError("a pool was started for a tiny input")

    monkeypatch.setattr(bpe_train, "in_order", no_pool)
    assert count_chunks(["to be or not to be"], PATTERNS["gpt2"], workers=4) == Counter(
        {"to": 1, " be": 2, " or": 1, " not": 1, " to": 1}
    )


# ----- cutting long documents ----------------------------------------------------------------

# Characters that make the GPT-2 and GPT-4 patterns work hard at a boundary: whitespace runs,
# "\r\n", Unicode spaces, contractions, digits, punctuation, combining marks.
BOUNDARY_PIECES = [
    "a", "Z", "é", "中", "😀", "\u0301", "1", "'", "'s", "'LL", ".", "!",
    " ", "  ", "\n", "\r", "\t", "\u00a0", "\u2028", "\x1c",
]
boundary_text = st.lists(st.sampled_from(BOUNDARY_PIECES), max_size=60).map("".join)


@settings(max_examples=500, deadline=None)
@given(text=boundary_text, max_chars=st.integers(1, 10))
def test_cutting_a_long_text_keeps_every_chunk(text, max_chars):
    pieces = list(split_long_text(text, max_chars))
    assert "".join(pieces) == text
    for name in ("gpt2", "gpt4"):
        pattern = regex.compile(PATTERNS[name])
        assert [chunk for piece in pieces for chunk in pattern.findall(piece)] == pattern.findall(text)


def test_counting_cut_documents_equals_counting_them_whole(shakespeare_corpus, monkeypatch):
    docs = list(shakespeare_corpus.texts())[:3]
    whole = {name: count_chunks(docs, PATTERNS[name], workers=1) for name in ("gpt2", "gpt4")}
    monkeypatch.setattr(bpe_train, "PIECE_CHARS", 1000)  # every play becomes 100+ pieces
    assert len(list(split_long_text(docs[0], 1000))) > 100
    for name in ("gpt2", "gpt4"):
        assert count_chunks(docs, PATTERNS[name], workers=1) == whole[name]


def test_other_patterns_are_never_cut(monkeypatch):
    monkeypatch.setattr(bpe_train, "PIECE_CHARS", 5)
    text = "to be\nor not to be\nthat is the question"
    assert count_chunks([text], PATTERNS["none"], workers=1) == Counter({text: 1})
    assert count_chunks([text], r"\S+\s*", workers=1) == Counter(regex.findall(r"\S+\s*", text))


# ----- sizes and errors ----------------------------------------------------------------------


def test_vocab_size_counts_bytes_merges_and_special_tokens():
    text = " ".join(f"{word}{i}" for i, word in enumerate(["the", "cat", "sat", "on", "mat"] * 40))
    assert len(train_merges([text], 300, PATTERNS["gpt2"], workers=1)) == 300 - 256 - 3
    assert len(train_merges([text], 300, PATTERNS["gpt2"], n_reserved=4, workers=1)) == 300 - 256 - 3 - 4
    assert train_merges([text], 259, PATTERNS["gpt2"], workers=1) == []  # the bytes alone


def test_too_small_a_vocabulary_is_an_error():
    with pytest.raises(TinyLMError, match="at least 259"):
        train_merges(["abc"], 258, PATTERNS["gpt4"])
    with pytest.raises(TinyLMError, match="at least 261"):
        train_merges(["abc"], 260, PATTERNS["gpt4"], n_reserved=2)


def test_bad_inputs_are_errors():
    with pytest.raises(TinyLMError, match="must be str"):
        train_merges([b"bytes are not text"], 300, PATTERNS["gpt4"], workers=1)
    with pytest.raises(TinyLMError, match="workers must be 1 or more"):
        train_merges(["abc"], 300, PATTERNS["gpt4"], workers=0)


def test_progress_bar_counts_merges(capsys):
    train_merges(["abcabcabd"], vocab_for(3), PATTERNS["none"], workers=1, progress=True)
    err = capsys.readouterr().err
    assert "BPE merges" in err and "3/3" in err
