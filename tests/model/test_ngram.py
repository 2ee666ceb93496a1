"""n-gram language models: known answers worked by hand, a textbook reference from the definitions,
nltk as an outside oracle, distributions summing to one, save/load and evaluation. Sampling goes
through the shared engine and its filters (tests/model/test_ngram_lm.py)."""

from __future__ import annotations

import json
import math
import warnings
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tinylm.data import Corpus, Document, prepare
from tinylm.errors import TinyLMError
from tinylm.model.ngram import NGramModel
from tinylm.tokenizers import CharTokenizer

# The hand-worked toy's vocabulary, laid out like a tinylm tokenizer's: base tokens, then specials.
A, B, BOS, EOS, PAD = 0, 1, 2, 3, 4
V = 5
TOY = [[A, B, A, EOS], [B, B, EOS], [A, B, EOS]]  # three documents: "a b a", "b b", "a b"

PROPER = [("mle", {}), ("add-k", {"k": 0.5}), ("kn", {}), ("kn", {"discount": 0.75})]  # sum to one
ALL = PROPER + [("kn-nltk", {})]


def toy(order: int, smoothing: str, **kw) -> NGramModel:
    return NGramModel.fit(TOY, order, vocab_size=V, bos_id=BOS, eos_id=EOS, smoothing=smoothing, **kw)


def random_corpus(seed: int, n_docs: int = 30, n_words: int = 8) -> tuple[np.ndarray, int, int, int]:
    """An EOS-separated stream over ``n_words`` word ids, plus BOS, EOS and one never-seen id."""
    rng = np.random.default_rng(seed)
    bos, eos, vocab = n_words, n_words + 1, n_words + 3  # n_words + 2 is PAD: never in the text
    docs = [np.append(rng.integers(0, n_words, size=rng.integers(1, 12)), eos) for _ in range(n_docs)]
    return np.concatenate(docs), bos, eos, vocab


# ----- known answers worked by hand ---------------------------------------------------------------
#
# The toy, order 3: each document is left-padded with two <s>, so the padded documents are
#   <s> <s> a b a </s>      <s> <s> b b </s>      <s> <s> a b </s>
# and the 10 targets end these trigrams, with their counts:
#   (<s> <s> a) 2   (<s> a b) 2   (a b a) 1   (b a </s>) 1   (a b </s>) 1
#   (<s> <s> b) 1   (<s> b b) 1   (b b </s>) 1
# The bigrams and unigrams ending at a target, with their raw counts:
#   (<s> a) 2  (a b) 2  (b a) 1  (a </s>) 1  (<s> b) 1  (b b) 1  (b </s>) 2;     a 3  b 4  </s> 3


def test_mle_by_hand():
    m = toy(3, "mle")
    # c(<s> <s> a) = 2, c(<s> <s>) = 3 (followed by a, b, a): 2/3
    assert m.logprob([], A) == pytest.approx(math.log(2 / 3))
    # c(<s> a b) = 2 = c(<s> a): 1; c(<s> a a) = 0: 0, log -inf
    assert m.logprob([A], B) == pytest.approx(0.0)
    assert m.logprob([A], A) == -math.inf
    # context (a b) is followed by a once and by </s> once: 1/2
    assert m.logprob([A, B], A) == pytest.approx(math.log(1 / 2))
    # context (a a) was never seen: MLE falls back to the longest seen suffix, (a), whose
    # bigrams at targets are (a b) twice and (a </s>) once: p(b | a) = 2/3
    assert m.logprob([A, A], B) == pytest.approx(math.log(2 / 3))
    # context (a PAD): PAD was never seen, so the unigram: c(a) = 3 of 10 targets
    assert m.logprob([A, PAD], A) == pytest.approx(math.log(3 / 10))
    # the training text itself: (2/3 * 1 * 1/2 * 1) (1/3 * 1 * 1) (2/3 * 1 * 1/2) = 1/27, 10 tokens
    assert -m.score(np.concatenate(TOY)).sum() == pytest.approx(math.log(27))


def test_add_k_by_hand():
    m = toy(3, "add-k", k=1.0)
    # (c(h w) + k) / (c(h) + k |V|), |V| = 5
    assert m.logprob([], A) == pytest.approx(math.log((2 + 1) / (3 + 5)))  # 3/8
    assert m.logprob([A], B) == pytest.approx(math.log((2 + 1) / (2 + 5)))  # 3/7
    assert m.logprob([A], A) == pytest.approx(math.log((0 + 1) / (2 + 5)))  # 1/7
    # an unseen context, c(h) = 0: uniform, 1/5
    assert m.logprob([A, A], B) == pytest.approx(math.log(1 / 5))


def test_kneser_ney_by_hand():
    m = toy(3, "kn", discount=0.5)
    # Unigram level: continuation counts N1+(. w) over the 7 bigram types at targets,
    #   a: {<s>, b} = 2,  b: {a, <s>, b} = 3,  </s>: {a, b} = 2,  <s>, PAD: 0   (raw: 3, 4, 3)
    #   gamma_1 = D * (3 words with N1+ > 0) / 7 = 1.5/7, handed to the uniform 1/5:
    #   p1(a) = (2 - .5)/7 + (1.5/7)/5 = 1.8/7;  p1(b) = 2.8/7;  p1(</s>) = 1.8/7;  p1(<s>) = 0.3/7
    p1 = {A: 1.8 / 7, B: 2.8 / 7, EOS: 1.8 / 7, BOS: 0.3 / 7, PAD: 0.3 / 7}
    # Bigram level: continuation counts N1+(. h w) over the trigram types:
    #   (<s> a) {<s>} 1   (a b) {<s>} 1 (raw 2)   (b a) {a} 1   (a </s>) {b} 1
    #   (<s> b) {<s>} 1   (b b) {<s>} 1           (b </s>) {b, a} 2
    # Context b: {a 1, b 1, </s> 2}, total 4, gamma = .5 * 3 types / 4 = .375.
    # Context a: {b 1, </s> 1}, total 2, gamma = .5 * 2/2 = .5 (raw counts would say b 2, </s> 1).
    # Context <s>: {a 1, b 1}, total 2, gamma = .5.
    p2_a_given_b = (1 - 0.5) / 4 + 0.375 * p1[A]  # = 0.2214...
    p2_eos_given_a = (1 - 0.5) / 2 + 0.5 * p1[EOS]  # = 0.3785...
    p2_a_given_s = (1 - 0.5) / 2 + 0.5 * p1[A]  # = 0.3785...
    # Trigram level, raw counts. Context (a b): {a 1, </s> 1}, total 2, gamma = .5 * 2/2 = .5
    assert m.logprob([A, B], A) == pytest.approx(math.log((1 - 0.5) / 2 + 0.5 * p2_a_given_b))  # 0.3607
    # context (<s> <s>): {a 2, b 1}, total 3, gamma = .5 * 2/3 = 1/3
    assert m.logprob([], A) == pytest.approx(math.log((2 - 0.5) / 3 + (1 / 3) * p2_a_given_s))  # 0.6262
    # the unseen context (a a) hands everything to the bigram context (a)
    assert m.logprob([A, A], EOS) == pytest.approx(math.log(p2_eos_given_a))
    # BOS is never a target: it gets only its share of the uniform part, through both gammas
    assert m.logprob([A, B], BOS) == pytest.approx(math.log(0.5 * 0.375 * p1[BOS]))
    assert m.next_token_distribution([A, B]).sum() == pytest.approx(1.0, abs=1e-12)


def test_modified_kneser_ney_discounts_by_hand():
    # Order 1 on one document a a a a b b b c c d e </s> (ids 0..4, BOS 5, EOS 6, PAD 7; |V| = 8):
    # counts a 4, b 3, c 2, d 1, e 1, </s> 1 (12 tokens), so the count-of-counts are
    #   n1 = 3 (d, e, </s>), n2 = 1 (c), n3 = 1 (b), n4 = 1 (a);
    #   Y = n1 / (n1 + 2 n2) = 3/5 = 0.6
    #   D1 = 1 - 2Y n2/n1 = 1 - 1.2/3 = 0.6;  D2 = 2 - 3Y n3/n2 = 0.2;  D3+ = 3 - 4Y n4/n3 = 0.6
    doc = [0, 0, 0, 0, 1, 1, 1, 2, 2, 3, 4, 6]
    m = NGramModel.fit([doc], 1, vocab_size=8, bos_id=5, eos_id=6, smoothing="kn")
    assert m.discounts == [pytest.approx((0.6, 0.2, 0.6))]
    # gamma = (3 x D1 + 1 x D2 + 2 x D3+) / 12 = 3.2/12, spread uniformly: 0.4/12 each
    expected = np.array([4 - 0.6, 3 - 0.6, 2 - 0.2, 1 - 0.6, 1 - 0.6, 0, 1 - 0.6, 0]) / 12 + 0.4 / 12
    np.testing.assert_allclose(m.next_token_distribution([]), expected, rtol=1e-12)


def test_nltk_formulation_by_hand():
    # nltk counts the everygrams of the padded documents, padding included: 8 bigram types
    #   (<s> <s>) (<s> a) (a b) (b a) (a </s>) (<s> b) (b b) (b </s>)
    # and 8 trigram types, those of the table above.
    m = toy(3, "kn-nltk", discount=0.1)
    # Unigram: bigram types ending in w over 8, no uniform part: a 2/8, b 3/8, </s> 2/8, and
    # <s> 1/8 (from the padding bigram). PAD, never seen, gets 0.
    # Context (b) at the bigram level: raw followers {a, b, </s>} -> 3 types; trigram types with
    # b in the middle: (a b a) (<s> b b) (b b </s>) (a b </s>) -> total 4, of them (. b a) -> 1.
    #   p2(a | b) = (1 - .1)/4 + (.1 * 3/4) * 2/8 = 0.24375
    # Context (a b) at the top, raw counts {a 1, </s> 1}:
    #   p3(a | a b) = (1 - .1)/2 + (.1 * 2/2) * 0.24375 = 0.474375
    assert math.exp(m.logprob([A, B], A)) == pytest.approx(0.474375)
    assert m.logprob([A, B], PAD) == -math.inf
    # Its quirk: context (<s>) has 3 raw follower types but only 2 trigram types through it, so
    # gamma = .1 * 3/2 = .15 and p2(. | <s>) sums to .45 + .45 + .15 = 1.05; at the top,
    # (<s> <s>) {a 2, b 1} gives (1.9 + .9)/3 + (.1 * 2/3) * 1.05 = 3.01/3. Not a distribution:
    # a compatibility mode, which is why the sum-to-one tests leave it out.
    assert m.next_token_distribution([]).sum() == pytest.approx(3.01 / 3)


def test_continuation_counts_prefer_versatile_words():
    # "Francisco" (F) is frequent but only ever follows "San" (S); "x" is rarer but follows many
    # words. As a continuation of a context never seen with either, KN ranks x above F.
    S, F, x = 0, 1, 2
    others = list(range(3, 9))
    doc = [S, F] * 10 + [w for o in others for w in (o, x)]  # c(F) = 10, c(x) = 6
    bos, eos, vocab = 9, 10, 12
    m = NGramModel.fit([doc], 2, vocab_size=vocab, bos_id=bos, eos_id=eos, smoothing="kn")
    mle = NGramModel.fit([doc], 2, vocab_size=vocab, bos_id=bos, eos_id=eos, smoothing="mle")
    unseen = [11]  # an id never seen as a context: both models fall back to their unigram level
    assert mle.next_token_distribution(unseen)[F] > mle.next_token_distribution(unseen)[x]
    assert m.next_token_distribution(unseen)[F] < m.next_token_distribution(unseen)[x]


# ----- a textbook reference from the definitions --------------------------------------------------


def reference_kn(docs: list[list[int]], order: int, vocab: int, bos: int, discount: float | None):
    """Interpolated (modified) Kneser-Ney straight from its definition, with dicts and sets."""
    grams: Counter[tuple[int, ...]] = Counter()  # every n-gram, orders 1..n, ending at a target
    for doc in docs:
        p = [bos] * (order - 1) + doc
        for t in range(order - 1, len(p)):
            for j in range(1, order + 1):
                grams[tuple(p[t - j + 1 : t + 1])] += 1

    def num(g: tuple[int, ...]) -> int:  # raw count at the top order, continuation count below
        if len(g) == order:
            return grams[g]
        return len({h[0] for h in grams if len(h) == len(g) + 1 and h[1:] == g})

    def discounts(j: int) -> tuple[float, ...]:
        if discount is not None:
            return (discount,) * 3
        n = Counter(num(g) for g in grams if len(g) == j)
        if min(n[1], n[2], n[3], n[4]) == 0:
            return (0.75,) * 3
        Y = n[1] / (n[1] + 2 * n[2])
        D = (1 - 2 * Y * n[2] / n[1], 2 - 3 * Y * n[3] / n[2], 3 - 4 * Y * n[4] / n[3])
        return D if all(0 < d <= r for r, d in zip((1, 2, 3), D)) else (0.75,) * 3

    Ds = {j: discounts(j) for j in range(1, order + 1)}

    def prob(w: int, h: tuple[int, ...]) -> float:
        lower = prob(w, h[1:]) if h else 1 / vocab
        children = {g[-1]: num(g) for g in grams if len(g) == len(h) + 1 and g[:-1] == h}
        children = {v: c for v, c in children.items() if c > 0}
        total = sum(children.values())
        if total == 0:
            return lower
        D = Ds[len(h) + 1]
        d = lambda c: D[min(c, 3) - 1]  # noqa: E731
        alpha = max(children.get(w, 0) - d(children[w]), 0) / total if w in children else 0.0
        return alpha + sum(d(c) for c in children.values()) / total * lower

    return prob


@pytest.mark.parametrize("order", [1, 2, 3, 4])
@pytest.mark.parametrize("discount", [None, 0.6])
def test_kneser_ney_matches_reference_from_definition(order, discount):
    stream, bos, eos, vocab = random_corpus(seed=order, n_docs=25, n_words=6)
    docs = np.split(stream, np.flatnonzero(stream == eos)[:-1] + 1)
    docs = [[int(t) for t in d] for d in docs]
    m = NGramModel.fit(stream, order, vocab_size=vocab, bos_id=bos, eos_id=eos, smoothing="kn", discount=discount)
    prob = reference_kn(docs, order, vocab, bos, discount)
    pad = vocab - 1  # never in the training text: an unseen token, then part of unseen contexts
    val = [3, 1, 4, 1, 5, pad, 2, eos, 0, 5, 5, 2, eos, 5]
    expected, ctx = [], []
    for t in val:
        h = ([bos] * (order - 1) + ctx)[len(ctx) :] if order > 1 else []
        expected.append(math.log(prob(t, tuple(h))))
        ctx = [] if t == eos else ctx + [t]
    np.testing.assert_allclose(m.score(np.array(val)), expected, rtol=1e-12)


# ----- nltk as an outside oracle ------------------------------------------------------------------


@pytest.mark.parametrize("order", [2, 3, 4, 5])
def test_kn_nltk_matches_nltk(order):
    from nltk import lm as nltk_lm
    from nltk.util import everygrams

    stream, bos, eos, vocab = random_corpus(seed=10 + order, n_docs=30, n_words=7)
    docs = [list(map(int, d)) for d in np.split(stream, np.flatnonzero(stream == eos)[:-1] + 1)]
    # nltk's vocabulary takes strings: the same ids, written as strings
    padded = [[str(t) for t in [bos] * (order - 1) + d] for d in docs]
    lm = nltk_lm.KneserNeyInterpolated(order)  # discount 0.1
    lm.fit([list(everygrams(p, max_len=order)) for p in padded], [t for p in padded for t in p])

    rng = np.random.default_rng(order)
    # random ids, PAD (never seen) included; BOS is never a target and EOS only ends a document
    val_docs = [[int(t) for t in rng.integers(0, vocab, size=10) if t not in (bos, eos)] + [eos] for _ in range(6)]
    theirs = []
    for d in val_docs:
        p = [str(t) for t in [bos] * (order - 1) + d]
        theirs += [lm.score(p[i], tuple(p[i - order + 1 : i])) for i in range(order - 1, len(p))]
    m = NGramModel.fit(stream, order, vocab_size=vocab, bos_id=bos, eos_id=eos, smoothing="kn-nltk")
    ours = np.exp(m.score(np.concatenate(val_docs)))
    assert (np.array(theirs) == 0).any()  # the test covers nltk's zero for an unseen token
    np.testing.assert_allclose(ours, theirs, rtol=1e-12, atol=0)


# ----- properties ---------------------------------------------------------------------------------


@pytest.mark.parametrize("smoothing,kw", PROPER, ids=[f"{s}{kw}" for s, kw in PROPER])
@pytest.mark.parametrize("order", [1, 2, 3, 4, 5, 6])
def test_distributions_sum_to_one(order, smoothing, kw):
    stream, bos, eos, vocab = random_corpus(seed=order)
    m = NGramModel.fit(stream, order, vocab_size=vocab, bos_id=bos, eos_id=eos, smoothing=smoothing, **kw)
    rng = np.random.default_rng(0)
    contexts = [[], [eos], [bos] * 3]
    contexts += [list(stream[s : s + rng.integers(1, 8)]) for s in rng.integers(0, len(stream) - 8, size=20)]  # seen
    contexts += [list(rng.integers(0, vocab, size=rng.integers(1, 8))) for _ in range(20)]  # mostly unseen
    for ctx in contexts:
        p = m.next_token_distribution(ctx)
        assert p.shape == (vocab,) and (p >= 0).all()
        assert p.sum() == pytest.approx(1.0, abs=1e-12), ctx


@settings(max_examples=25, deadline=None)
@given(
    docs=st.lists(st.lists(st.integers(0, 4), min_size=0, max_size=10), min_size=1, max_size=6),
    order=st.integers(1, 6),
    smoothing=st.sampled_from(["mle", "add-k", "kn"]),
    context=st.lists(st.integers(0, 7), max_size=6),
)
def test_distributions_sum_to_one_on_any_corpus(docs, order, smoothing, context):
    # ids 0..4 words, 5 BOS, 6 EOS, 7 PAD; documents may be empty (just EOS)
    m = NGramModel.fit([d + [6] for d in docs], order, vocab_size=8, bos_id=5, eos_id=6, smoothing=smoothing)
    assert m.next_token_distribution(context).sum() == pytest.approx(1.0, abs=1e-12)


@pytest.mark.parametrize(
    "order,smoothing,kw",
    [(n, s, kw) for n in range(1, 7) for s, kw in ALL if not (s == "kn-nltk" and n == 1)],  # nltk's needs n >= 2
)
def test_vectorised_score_equals_per_token_loop(order, smoothing, kw):
    stream, bos, eos, vocab = random_corpus(seed=100 + order)
    m = NGramModel.fit(stream[:200], order, vocab_size=vocab, bos_id=bos, eos_id=eos, smoothing=smoothing, **kw)
    text = stream[150:]  # half seen, half new; it starts mid-document, which counts as a document start
    fast = m.score(text)
    slow = [m.logprob(text[:i], int(text[i])) for i in range(len(text))]  # the history, EOS and all
    np.testing.assert_array_equal(np.isinf(fast), np.isinf(slow))
    np.testing.assert_allclose(fast, slow, rtol=1e-12)


def test_stream_and_document_list_count_the_same():
    stream, bos, eos, vocab = random_corpus(seed=3)
    docs = [d[:-1] for d in np.split(stream, np.flatnonzero(stream == eos)[:-1] + 1)]  # EOS appended back
    a = NGramModel.fit(stream, 4, vocab_size=vocab, bos_id=bos, eos_id=eos)
    b = NGramModel.fit(docs, 4, vocab_size=vocab, bos_id=bos, eos_id=eos)
    for ka, kb, ca, cb in zip(a.keys, b.keys, a.counts, b.counts):
        np.testing.assert_array_equal(ka, kb)
        np.testing.assert_array_equal(ca, cb)


def test_high_order_over_a_large_vocabulary():
    # |V|^6 = 6.4e31 does not fit in 64 bits; the trie keys row(h) |V| + w do
    vocab = 200_000
    rng = np.random.default_rng(0)
    stream = np.append(rng.integers(0, 1000, size=2000) * 199, vocab - 2)  # ids spread over the vocabulary
    m = NGramModel.fit(stream, 6, vocab_size=vocab, bos_id=vocab - 3, eos_id=vocab - 2)
    assert m.next_token_distribution(stream[:10]).sum() == pytest.approx(1.0, abs=1e-12)
    assert -m.score(stream).mean() < math.log(3)  # a 6-gram all but memorises 2000 random tokens


# ----- evaluation ---------------------------------------------------------------------------------


def test_unseen_tokens_infinite_for_mle_finite_when_smoothed():
    text = np.array([A, B, PAD, A, EOS])  # PAD never occurs in training
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no divide-by-zero spew: infinity is the answer, not an accident
        for order in (1, 3):
            mle = toy(order, "mle").evaluate(text, n_bytes=4)
            assert mle.loss == math.inf and mle.perplexity == math.inf and mle.bits_per_byte == math.inf
            for smoothing, kw in PROPER[1:]:
                r = toy(order, smoothing, **kw).evaluate(text, n_bytes=4)
                assert math.isfinite(r.perplexity) and math.isfinite(r.bits_per_byte)


def memory_corpus(texts: list[str]) -> Corpus:
    return Corpus("memory", lambda corpus: iter([Document(f"d{i}", t) for i, t in enumerate(texts)]))


def test_bits_per_byte_on_shards(tmp_path):
    line = "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer. "
    texts = [line * (i % 3 + 1) + f"Act {i}. Ünïcödé costs bytes." for i in range(12)]
    tok = CharTokenizer.train(texts)
    shards = prepare(memory_corpus(texts), tok, tmp_path, val_fraction=0.25, workers=1)
    m = NGramModel.fit_shards(shards, 3)
    r = m.evaluate_shards(shards, "val")
    n_tokens, n_bytes = shards.num_tokens("val"), shards.meta["splits"]["val"]["bytes"]
    assert r.tokens == n_tokens and r.bytes == n_bytes
    # bits per byte = loss x tokens / (bytes x ln 2), and the loss is the mean of -score
    assert r.loss == pytest.approx(-m.score(shards.tokens("val")).mean(), rel=1e-12)
    assert r.bits_per_byte == pytest.approx(r.loss * n_tokens / (n_bytes * math.log(2)), rel=1e-12)
    assert r.perplexity == pytest.approx(math.exp(r.loss))
    assert 0 < r.bits_per_byte < 8
    assert m.vocab_size == tok.vocab_size and m.bos_id == tok.bos_id and m.eos_id == tok.eos_id


# ----- saving and loading -------------------------------------------------------------------------


@pytest.mark.parametrize("smoothing,kw", ALL, ids=[f"{s}{kw}" for s, kw in ALL])
def test_save_load_round_trip(tmp_path, smoothing, kw):
    stream, bos, eos, vocab = random_corpus(seed=7)
    m = NGramModel.fit(stream[:250], 4, vocab_size=vocab, bos_id=bos, eos_id=eos, smoothing=smoothing, **kw)
    path = m.save(tmp_path / "model.npz")
    back = NGramModel.load(path)
    np.testing.assert_array_equal(back.score(stream), m.score(stream))  # bit for bit
    assert back.header() == m.header()
    # the documented format: no pickles, a JSON header, keys and counts per order
    with np.load(path, allow_pickle=False) as npz:
        assert sorted(npz.files) == sorted(["header"] + [f"{a}_{j}" for a in ("keys", "counts") for j in range(1, 5)])
        header = json.loads(npz["header"].tobytes())
    assert header["format"] == "tinylm.ngram" and header["version"] == 1 and header["order"] == 4


def test_load_refuses_other_files(tmp_path):
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(TinyLMError, match="not a readable"):
        NGramModel.load(tmp_path / "junk.npz")
    np.savez(tmp_path / "other.npz", x=np.zeros(3))
    with pytest.raises(TinyLMError, match="not a tinylm n-gram model"):
        NGramModel.load(tmp_path / "other.npz")
    header = np.frombuffer(json.dumps({"format": "tinylm.ngram", "version": 99}).encode(), dtype=np.uint8)
    np.savez(tmp_path / "future.npz", header=header)
    with pytest.raises(TinyLMError, match="version 99"):
        NGramModel.load(tmp_path / "future.npz")
    with pytest.raises(TinyLMError, match="does not exist"):
        NGramModel.load(tmp_path / "missing.npz")


def test_load_refuses_cut_and_corrupt_files_in_one_line(tmp_path):
    """A file cut short, an empty one, text, or tables that break the lookups' invariants: a TinyLMError that says
    the file is unreadable or corrupt, never numpy's own exception (a traceback in the CLI)."""
    stream, bos, eos, vocab = random_corpus(seed=7)
    good = NGramModel.fit(stream[:250], 3, vocab_size=vocab, bos_id=bos, eos_id=eos).save(tmp_path / "good.npz")
    data = good.read_bytes()
    for name, content in [("cut.npz", data[: len(data) // 2]), ("empty.npz", b""), ("text.npz", b"hi\n")]:
        (tmp_path / name).write_bytes(content)
        with pytest.raises(TinyLMError, match="not a readable n-gram model file .*count it again"):
            NGramModel.load(tmp_path / name)
    refused = 0
    for position in range(0, len(data), max(1, len(data) // 60)):  # one byte flipped: damaged deflated data, CRCs
        damaged = bytearray(data)
        damaged[position] ^= 0xFF
        (tmp_path / "flipped.npz").write_bytes(bytes(damaged))
        try:
            NGramModel.load(tmp_path / "flipped.npz")
        except TinyLMError as e:
            assert "\n" not in str(e) and ("count it again" in str(e) or "fit" in str(e)), position
            refused += 1
    assert refused >= 30  # most flips damage the archive (zlib's and zip's checks); none escapes as a traceback
    with np.load(good, allow_pickle=False) as npz:
        arrays = {name: npz[name] for name in npz.files}
    header = json.loads(arrays["header"].tobytes())
    broken = {
        "short counts": {"counts_2": arrays["counts_2"][:-1]},
        "unsorted keys": {"keys_2": arrays["keys_2"][::-1].copy()},
        "key past the table": {"keys_3": np.append(arrays["keys_3"], len(arrays["keys_2"]) * vocab)},
        "negative count": {"counts_1": -arrays["counts_1"].astype(np.int64)},
        "float keys": {"keys_2": arrays["keys_2"].astype(np.float64) + 0.5},
        "2-D tables": {"keys_2": arrays["keys_2"][:, None], "counts_2": arrays["counts_2"][:, None]},
        "bad vocab size": {"header": np.frombuffer(json.dumps({**header, "vocab_size": 2}).encode(), np.uint8)},
    }
    for what, change in broken.items():
        np.savez(tmp_path / "bad.npz", **{**arrays, **change})
        with pytest.raises(TinyLMError, match="is a corrupt n-gram model file .*count it again") as e:
            NGramModel.load(tmp_path / "bad.npz")
        assert "\n" not in str(e.value), what
    np.savez(tmp_path / "same.npz", **arrays)  # the same tables rewritten load as the original
    np.testing.assert_array_equal(NGramModel.load(tmp_path / "same.npz").score(stream),
                                  NGramModel.load(good).score(stream))


# ----- errors -------------------------------------------------------------------------------------


def test_bad_settings_are_errors():
    with pytest.raises(TinyLMError, match="order"):
        toy(0, "kn")
    with pytest.raises(TinyLMError, match="unknown smoothing"):
        toy(3, "good-turing")
    with pytest.raises(TinyLMError, match="outside the vocabulary"):
        NGramModel.fit([[0, 9]], 2, vocab_size=V, bos_id=BOS, eos_id=EOS)
    with pytest.raises(TinyLMError, match="outside the vocabulary"):
        toy(2, "kn").score([0, -1])
    with pytest.raises(TinyLMError, match="tokenizer, or vocab_size"):
        NGramModel.fit(TOY, 2)
    with pytest.raises(TinyLMError, match="order 2 or more"):
        toy(1, "kn-nltk")
