"""n-gram language models: the first "large" language models, built by counting.

An n-gram model makes the Markov assumption: the next token depends only on the n-1 tokens
before it,

    p(x_t | x_1 .. x_{t-1})  ~  p(x_t | x_{t-n+1} .. x_{t-1}) = p(w | h),

with h the *context* (n-1 tokens) and w the token predicted. Usage::

    model = NGramModel.fit(train_ids, order=5, tokenizer=tok)      # smoothing="kn" by default
    model = NGramModel.fit_shards(shards, order=5)                 # from `tinylm prepare` output
    result = model.evaluate(val_ids, n_bytes)                      # an EvalResult: loss, perplexity, bpb
    logp = model.score(val_ids)                                    # (T,) log p of every token, vectorised
    probs = model.next_token_distribution(context)                 # (|V|,), sums to one
    model.save("shakespeare-5gram.npz"); model = NGramModel.load("shakespeare-5gram.npz")

Generation goes through the shared engine and its sampling filters: `tinylm.model.ngram_lm.NGramLM`
puts the model behind the neural models' forward.

Counting is maximum likelihood
------------------------------
Among all conditional distributions, the one that gives the training text the highest
probability is the relative frequency ``p_ML(w | h) = c(h w) / c(h)``, where ``c(h w)`` counts
the n-gram and ``c(h) = sum_w c(h w)`` its context. So "training" an n-gram model is counting
(``smoothing="mle"``).

Why smoothing
-------------
Most n-grams are never seen: with |V| = 4096 there are 4096^4 possible 5-grams and a corpus
has a few million tokens. Maximum likelihood gives every unseen n-gram probability zero, so a
single new n-gram in the validation text makes its probability zero and its perplexity
infinite. Smoothing takes some probability away from what was seen and gives it to what was not:

- ``add-k`` pretends every n-gram was seen k more times:
  ``p(w | h) = (c(h w) + k) / (c(h) + k |V|)``. It is the same as mixing the maximum-likelihood
  estimate with the uniform distribution, with weight ``lambda = c(h) / (c(h) + k |V|)`` on the
  counts: with a large vocabulary, most of the mass goes to the uniform part, which is why add-k
  is a weak model.
- interpolated Kneser-Ney (``kn``) subtracts a fixed *discount* D from every seen count and
  hands the freed mass to the next-shorter context, recursively down to the uniform
  distribution::

      p_j(w | h) = max(c(h w) - D, 0) / c(h)  +  gamma(h) p_{j-1}(w | h'),
      gamma(h)   = D * N1+(h .) / c(h)                  (N1+(h .): distinct words seen after h)

  where h' is h without its oldest token. The lower orders do not use raw counts but
  *continuation counts* ``N1+(. h w)``: the number of distinct tokens seen *before* h w. The
  intuition: a lower-order distribution is only consulted when the longer context did not
  predict w, i.e. for w as a *novel continuation*. "Francisco" is frequent, but nearly always
  after "San"; as a continuation of a context never seen with it, it is rare. Its continuation
  count is 1, which says just that. With one discount D this is "interpolated KN"; the
  *modified* KN of Chen & Goodman (1998), our default, uses three discounts D1, D2, D3+ for
  counts of 1, 2 and 3 or more, estimated per order from the count-of-counts n_r (how many
  n-grams were seen exactly r times)::

      Y = n1 / (n1 + 2 n2),   D1 = 1 - 2Y n2/n1,   D2 = 2 - 3Y n3/n2,   D3+ = 3 - 4Y n4/n3.

  (Where a count-of-counts is zero or an estimate leaves (0, r], as on tiny texts, all three
  fall back to D = 0.75; `NGramModel.discounts` says what was used.)

Every smoothed model here is one *interpolation chain*: a base distribution p_0, then for each
order j = 1..n, ``p_j(w|h) = alpha_j(h w) + gamma_j(h) p_{j-1}(w|h')`` where the context h of
order j was seen (and p_j = p_{j-1} where it was not). MLE has gamma = 0 (so the longest seen
context wins outright), add-k has a single level over a uniform base, Kneser-Ney all n levels
over a uniform base. Scoring and next-token distributions walk that one chain.

The vocabulary, padding and document ends
-----------------------------------------
Every distribution is over the tokenizer's whole vocabulary, ``|V| = tokenizer.vocab_size``,
special tokens included, and sums to one over it. BOS (``<s>``) is never a target, so smoothing
gives it (and PAD, and the reserved ids) only its share of the uniform part: a tiny, honest
waste that keeps the rule simple and the same for every tokenizer. Each document is left-padded
with n-1 BOS tokens, so its first token is predicted from the context ``<s> .. <s>``; EOS ends a
document and is predicted like any other token. In a token stream (a shard) documents are
separated by EOS: the context restarts after every EOS, in training and in scoring.

MLE on a context never seen in training is undefined; we use the longest suffix of the context
that was seen (ultimately the unigram distribution), so ``next_token_distribution`` is always
a distribution. An unseen *token* still gets probability zero, hence infinite perplexity.

How the counts are stored, and the file format
----------------------------------------------
See `tinylm.model.ngram_counts`: the n-grams of each order are one sorted array of integer keys (a
trie level), counting is ``np.unique`` and lookup ``np.searchsorted``; `save` writes the count
tables and a JSON header to one ``.npz`` file, and everything else is recomputed on load.

nltk's formulation
------------------
``smoothing="kn-nltk"`` reproduces ``nltk.lm.KneserNeyInterpolated`` exactly, for comparing
against it. That model, trained on the everygrams (all n-grams of orders 1..n) of the same
padded documents, differs from ours in three ways: one discount (0.1 by default); its unigram
level is the continuation-count distribution with no uniform part, so a token never seen
in training gets probability 0 (infinite perplexity); and its lower levels count n-grams made
only of padding and take gamma's numerator from raw counts but its denominator from
continuation counts, so its distributions need not sum to one. It is a compatibility mode, not
a recommendation; order 1 is not supported (nltk divides by zero there).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from tinylm.errors import TinyLMError
from tinylm.model.eval_result import EvalResult
from tinylm.model.ngram_counts import (
    NGRAM_FILE,
    TokenData,
    as_stream,
    check_ids,
    check_tables,
    count_ngrams,
    lookup,
    pad_documents,
    read_tables,
    suffix_rows,
    write_tables,
)

if TYPE_CHECKING:  # only for annotations: the model wing does not depend on the data wing
    from tinylm.data.shards import ShardSet
    from tinylm.tokenizers.base import Tokenizer

SMOOTHINGS = ("mle", "add-k", "kn", "kn-nltk")
"""``mle``: counts only; ``add-k``: add k to every count; ``kn``: interpolated Kneser-Ney
(modified, three estimated discounts, unless one ``discount`` is given); ``kn-nltk``: nltk's
KneserNeyInterpolated formulation, for comparison with it."""

FALLBACK_DISCOUNT = 0.75  # the classic single KN discount, used where n_r cannot be estimated
NLTK_DISCOUNT = 0.1  # nltk.lm.KneserNeyInterpolated's default


@dataclass
class _Level:
    """Order j of the chain: p_j(w|h) = alpha[row(h w)] + gamma[row(h)] p_{j-1}(w|h'), if active[row(h)]."""

    alpha: np.ndarray  # (rows of order j,) float64: the discounted share of each seen n-gram
    gamma: np.ndarray  # (rows of order j-1,) float64: the mass each context hands down
    active: np.ndarray  # (rows of order j-1,) bool: this order applies to that context


# ----- the model -----------------------------------------------------------------------------------


class NGramModel:
    """An n-gram language model over token ids: counts in a sorted-key trie, one smoothing chain.

    Build one with `fit` or `fit_shards`, read one with `load`; see the module docstring.
    """

    def __init__(
        self,
        keys: list[np.ndarray],
        counts: list[np.ndarray],
        *,
        vocab_size: int,
        bos_id: int,
        eos_id: int,
        smoothing: str = "kn",
        k: float = 1.0,
        discount: float | None = None,
        train_tokens: int = 0,
        train_documents: int = 0,
        tokenizer_fingerprint: str | None = None,
    ) -> None:
        """From count tables (as `fit` makes them); use `fit`, `fit_shards` or `load` instead."""
        self.order = len(keys)
        self.vocab_size = int(vocab_size)
        self.bos_id = int(bos_id)
        self.eos_id = int(eos_id)
        self.keys = keys  # keys[j-1]: sorted int64 keys of order j, row(h) * |V| + w
        self.counts = [c.astype(np.int64, copy=False) for c in counts]  # times each ended at a target
        self.train_tokens = int(train_tokens)
        self.train_documents = int(train_documents)
        self.tokenizer_fingerprint = tokenizer_fingerprint  # the tokenizer whose ids were counted, if known
        _check_settings(self.order, self.vocab_size, self.bos_id, self.eos_id, smoothing, k, discount)
        self.smoothing = smoothing
        self.k = float(k)
        self.discount = discount
        self._suffix = suffix_rows(self.keys, self.vocab_size)
        self.discounts: list[tuple[float, float, float]] = []  # per order, kn only: (D1, D2, D3+)
        self._base, self._levels = self._chain()

    # ----- building ---------------------------------------------------------------------------

    @classmethod
    def fit(
        cls,
        data: TokenData,
        order: int,
        *,
        tokenizer: Tokenizer | None = None,
        vocab_size: int | None = None,
        bos_id: int | None = None,
        eos_id: int | None = None,
        smoothing: str = "kn",
        k: float = 1.0,
        discount: float | None = None,
    ) -> NGramModel:
        """Count every n-gram of orders 1..``order`` in ``data`` and smooth.

        ``data`` is a token stream with EOS after each document (a 1-D array or list, e.g. a
        shard), or a list of documents (EOS appended to any that lacks it). The vocabulary
        size and the BOS / EOS ids come from ``tokenizer`` or are given. ``k`` is add-k's
        pseudo-count; ``discount`` fixes KN's single discount (None: modified KN's three
        estimated discounts; for ``kn-nltk`` None means nltk's default 0.1).
        """
        vocab_size, bos_id, eos_id = _vocab(tokenizer, vocab_size, bos_id, eos_id)
        _check_settings(order, vocab_size, bos_id, eos_id, smoothing, k, discount)
        stream = as_stream(data, eos_id)
        if len(stream) == 0:
            raise TinyLMError("there is no text to count: give at least one token")
        check_ids(stream, vocab_size)
        keys, counts = count_ngrams(stream, order, vocab_size, bos_id, eos_id)
        n_docs = int(np.count_nonzero(stream == eos_id) + (stream[-1] != eos_id))
        return cls(keys, counts, vocab_size=vocab_size, bos_id=bos_id, eos_id=eos_id, smoothing=smoothing,
                   k=k, discount=discount, train_tokens=len(stream), train_documents=n_docs,
                   tokenizer_fingerprint=tokenizer.fingerprint() if tokenizer is not None else None)

    @classmethod
    def fit_shards(cls, shards: ShardSet, order: int, *, split: str = "train", **kwargs: Any) -> NGramModel:
        """`fit` on a split of prepared token shards (documents already end in EOS)."""
        tok = shards.tokenizer()
        return cls.fit(shards.tokens(split), order, tokenizer=tok, **kwargs)

    def with_smoothing(self, smoothing: str, *, k: float = 1.0, discount: float | None = None) -> NGramModel:
        """The same counts under another smoothing (no recounting)."""
        return NGramModel(self.keys, self.counts, vocab_size=self.vocab_size, bos_id=self.bos_id,
                          eos_id=self.eos_id, smoothing=smoothing, k=k, discount=discount,
                          train_tokens=self.train_tokens, train_documents=self.train_documents,
                          tokenizer_fingerprint=self.tokenizer_fingerprint)

    def _continuation(self, j: int, only_counted: bool) -> np.ndarray:
        """N1+(. g) for every n-gram g of order j < n: how many distinct tokens precede it.

        Counted over the n-grams of order j+1 that end at a real token (``only_counted``,
        Kneser-Ney) or over all of them, padding-only ones included (nltk's everygrams).
        """
        above = self._suffix[j]  # (rows of order j+1,) suffix rows in order j
        if only_counted:
            above = above[self.counts[j] > 0]
        return np.bincount(above, minlength=len(self.keys[j - 1]))

    def _n_contexts(self, j: int) -> int:
        return len(self.keys[j - 2]) if j > 1 else 1

    def _prefix(self, j: int) -> np.ndarray:
        return self.keys[j - 1] // self.vocab_size

    def _chain(self) -> tuple[float, list[_Level | None]]:
        """The base distribution's value (uniform or 0) and the levels of the interpolation chain."""
        n = self.order
        V = self.vocab_size
        levels: list[_Level | None] = []
        if self.smoothing == "mle":
            for j in range(1, n + 1):
                c = self.counts[j - 1].astype(np.float64)
                total = np.bincount(self._prefix(j), weights=c, minlength=self._n_contexts(j))
                alpha = c / np.maximum(total, 1.0)[self._prefix(j)]
                # gamma 0: the longest context seen in training decides alone
                levels.append(_Level(alpha, np.zeros_like(total), total > 0))
            return 0.0, levels

        if self.smoothing == "add-k":
            # (c + k) / (C + k|V|) = c / (C + k|V|) + [k|V| / (C + k|V|)] * (1/|V|): one level over uniform
            c = self.counts[n - 1].astype(np.float64)
            total = np.bincount(self._prefix(n), weights=c, minlength=self._n_contexts(n))
            denom = total + self.k * V
            alpha = c / denom[self._prefix(n)]
            levels = [None] * (n - 1) + [_Level(alpha, self.k * V / denom, np.ones(len(total), dtype=bool))]
            return 1.0 / V, levels

        if self.smoothing == "kn":
            for j in range(1, n + 1):
                # raw counts at the highest order, continuation counts below it
                num = self.counts[j - 1] if j == n else self._continuation(j, only_counted=True)
                D = self._discounts(num)
                self.discounts.append(D)
                d = np.array([0.0, *D])[np.minimum(num, 3)]  # each n-gram's discount: D1, D2 or D3+
                prefix = self._prefix(j)
                total = np.bincount(prefix, weights=num.astype(np.float64), minlength=self._n_contexts(j))
                safe = np.maximum(total, 1.0)
                alpha = np.maximum(num - d, 0.0) / safe[prefix]
                gamma = np.bincount(prefix, weights=d, minlength=len(total)) / safe
                levels.append(_Level(alpha, gamma, total > 0))
            return 1.0 / V, levels

        # kn-nltk: nltk's KneserNey + InterpolatedLanguageModel, read off its source
        d = NLTK_DISCOUNT if self.discount is None else self.discount
        # order 1: continuation counts over every bigram type, padding included; no uniform part
        num = self._continuation(1, only_counted=False).astype(np.float64)
        levels.append(_Level(num / num.sum(), np.zeros(1), np.ones(1, dtype=bool)))
        for j in range(2, n + 1):
            num = (self.counts[j - 1] if j == n else self._continuation(j, only_counted=False)).astype(np.float64)
            prefix = self._prefix(j)
            total = np.bincount(prefix, weights=num, minlength=self._n_contexts(j))
            types = np.bincount(prefix, minlength=len(total))  # distinct continuations in raw counts
            safe = np.maximum(total, 1.0)  # total > 0 wherever types > 0 (see the module docstring)
            alpha = np.maximum(num - d, 0.0) / safe[prefix]
            levels.append(_Level(alpha, d * types / safe, types > 0))
        return 0.0, levels

    def _discounts(self, num: np.ndarray) -> tuple[float, float, float]:
        """KN discounts for counts of 1, 2 and 3+: the given one, or estimated from count-of-counts."""
        if self.discount is not None:
            return (self.discount,) * 3
        n1, n2, n3, n4 = (int(np.count_nonzero(num == r)) for r in (1, 2, 3, 4))
        if min(n1, n2, n3, n4) == 0:
            return (FALLBACK_DISCOUNT,) * 3
        Y = n1 / (n1 + 2 * n2)
        D = (1 - 2 * Y * n2 / n1, 2 - 3 * Y * n3 / n2, 3 - 4 * Y * n4 / n3)
        # a discount must lie in (0, r] for the freed mass to be positive and no count to go negative
        if not all(0 < Dr <= r for r, Dr in zip((1, 2, 3), D)):
            return (FALLBACK_DISCOUNT,) * 3
        return D

    # ----- scoring ----------------------------------------------------------------------------

    def _rows(self, padded: np.ndarray, offset: np.ndarray) -> list[np.ndarray]:
        """rows[j][q]: row of the length-j window ending at q (-1: unseen or not in one document); rows[0] = 0."""
        V = self.vocab_size
        rows = [np.zeros(len(padded), dtype=np.int64)]
        for j in range(1, self.order + 1):
            r = np.full(len(padded), -1, dtype=np.int64)
            q = np.flatnonzero(offset >= j - 1)
            if j > 1:
                q = q[rows[j - 1][q - 1] >= 0]  # an unseen prefix has no seen extension
                r[q] = lookup(self.keys[j - 1], rows[j - 1][q - 1] * V + padded[q])
            else:
                r[q] = lookup(self.keys[0], padded[q])
            rows.append(r)
        return rows

    def score(self, tokens: TokenData) -> np.ndarray:
        """Natural log-probability of every token of an EOS-separated stream, (T,) float64.

        Vectorised: one pass per order over the whole array. -inf where the model gives 0.
        """
        stream = as_stream(tokens, self.eos_id)
        check_ids(stream, self.vocab_size)
        padded, offset, targets = pad_documents(stream, self.order, self.bos_id, self.eos_id)
        if len(targets) == 0:
            return np.empty(0, dtype=np.float64)
        rows = self._rows(padded, offset)
        p = np.full(len(targets), self._base)
        for j, level in enumerate(self._levels, start=1):
            if level is None:
                continue
            ctx = rows[j - 1][targets - 1] if j > 1 else np.zeros(len(targets), dtype=np.int64)
            gram = rows[j][targets]
            use = ctx >= 0
            use[use] = level.active[ctx[use]]
            alpha = np.where(gram >= 0, level.alpha[np.maximum(gram, 0)], 0.0)
            p = np.where(use, alpha + level.gamma[np.maximum(ctx, 0)] * p, p)
        with np.errstate(divide="ignore"):  # log 0 = -inf is the answer for an impossible token
            return np.log(p)

    def next_token_distribution(self, context: Sequence[int] | np.ndarray = ()) -> np.ndarray:
        """p(. | context) over the whole vocabulary, (|V|,) float64.

        ``context`` is the token history; the document restarts after its last EOS, and the
        part used is its last n-1 tokens, left-padded with BOS. Computed from each context's
        children slice of the trie, a separate path from `score` (the tests pin them equal).
        """
        V = self.vocab_size
        ctx = [int(t) for t in context]
        check_ids(np.asarray(ctx, dtype=np.int64), V)
        if self.eos_id in ctx:
            ctx = ctx[len(ctx) - ctx[::-1].index(self.eos_id):]
        ctx = ([self.bos_id] * (self.order - 1) + ctx)[len(ctx):] if self.order > 1 else []  # exactly n-1
        p = np.full(V, self._base)
        for j, level in enumerate(self._levels, start=1):
            if level is None:
                continue
            row = self._context_row(ctx[len(ctx) - (j - 1):] if j > 1 else [])
            if row < 0 or not level.active[row]:
                continue
            lo, hi = np.searchsorted(self.keys[j - 1], [row * V, (row + 1) * V])
            p = level.gamma[row] * p
            p[self.keys[j - 1][lo:hi] - row * V] += level.alpha[lo:hi]
        return p

    def _context_row(self, context: Sequence[int]) -> int:
        """Row of a (j-1)-token context in order j-1, walking the trie from the root; -1 if unseen."""
        row = 0
        for i, tok in enumerate(context):
            row = int(lookup(self.keys[i], np.array([row * self.vocab_size + tok]))[0])
            if row < 0:
                return -1
        return row

    def logprob(self, context: Sequence[int] | np.ndarray, token: int) -> float:
        """log p(token | context), natural log (-inf if impossible). For many tokens use `score`."""
        p = float(self.next_token_distribution(context)[token])
        return math.log(p) if p > 0 else -math.inf

    def evaluate(self, tokens: TokenData, n_bytes: float, split: str = "text") -> EvalResult:
        """Loss per token, perplexity and bits per byte on a stream whose text is ``n_bytes`` UTF-8 bytes
        (``split`` names it in the result); scored all in one piece, with no windows."""
        logp = self.score(tokens)
        if len(logp) == 0:
            raise TinyLMError("there are no tokens to evaluate")
        if n_bytes <= 0:
            raise TinyLMError(f"the text's size in bytes must be positive, got {n_bytes}")
        return EvalResult.without_windows(split, float(-logp.sum()), len(logp), n_bytes)

    def evaluate_shards(self, shards: ShardSet, split: str = "val") -> EvalResult:
        """`evaluate` on a split of token shards, its byte count from the shards' meta."""
        if shards.vocab_size != self.vocab_size or shards.eos_id != self.eos_id:
            raise TinyLMError(
                f"these shards use a tokenizer with {shards.vocab_size} tokens (EOS {shards.eos_id}), "
                f"the model {self.vocab_size} (EOS {self.eos_id}); evaluate on shards of the same tokenizer"
            )
        return self.evaluate(shards.tokens(split), shards.meta["splits"][split]["bytes"], split)

    # ----- saving and loading -----------------------------------------------------------------

    def header(self) -> dict[str, Any]:
        return {
            **NGRAM_FILE.header(),
            "order": self.order,
            "vocab_size": self.vocab_size,
            "bos_id": self.bos_id,
            "eos_id": self.eos_id,
            "smoothing": self.smoothing,
            "k": self.k,
            "discount": self.discount,
            "discounts": [list(D) for D in self.discounts],  # for reading only: recomputed on load
            "train_tokens": self.train_tokens,
            "train_documents": self.train_documents,
            "tokenizer_fingerprint": self.tokenizer_fingerprint,  # null when counted from bare ids
        }

    def save(self, path: str | os.PathLike) -> Path:
        """Write the model as one .npz file (see `tinylm.model.ngram_counts`), atomically."""
        return write_tables(path, self.header(), self.keys, self.counts)

    @classmethod
    def load(cls, path: str | os.PathLike) -> NGramModel:
        """Read a model written by `save`."""
        path = Path(path)
        header, arrays = read_tables(path)
        try:
            order = int(header["order"])
            keys = [arrays[f"keys_{j}"] for j in range(1, order + 1)]
            counts = [arrays[f"counts_{j}"] for j in range(1, order + 1)]
            check_tables(keys, counts, int(header["vocab_size"]))
            keys = [k.astype(np.int64, copy=False) for k in keys]
            counts = [c.astype(np.int64) for c in counts]
            return cls(keys, counts, vocab_size=header["vocab_size"], bos_id=header["bos_id"],
                       eos_id=header["eos_id"], smoothing=header["smoothing"], k=header["k"],
                       discount=header["discount"], train_tokens=header["train_tokens"],
                       train_documents=header["train_documents"],
                       tokenizer_fingerprint=header.get("tokenizer_fingerprint"))
        except (KeyError, TypeError, ValueError, TinyLMError) as e:
            reason = str(e) if isinstance(e, TinyLMError) else f"{type(e).__name__}: {e}"
            raise TinyLMError(f"{path} is a corrupt n-gram model file ({reason}); count it again") from None

    @property
    def nbytes(self) -> int:
        """Memory held by the model's arrays: the tables, suffix pointers and the smoothing chain."""
        arrays = [*self.keys, *self.counts, *self._suffix]
        for level in self._levels:
            if level is not None:
                arrays += [level.alpha, level.gamma, level.active]
        return sum(a.nbytes for a in arrays)

    def __repr__(self) -> str:
        sizes = ", ".join(str(len(k)) for k in self.keys)
        return (f"NGramModel(order={self.order}, smoothing={self.smoothing!r}, "
                f"vocab_size={self.vocab_size}, n-grams=[{sizes}])")


# ----- checks --------------------------------------------------------------------------------------


def _vocab(
    tokenizer: Tokenizer | None, vocab_size: int | None, bos_id: int | None, eos_id: int | None
) -> tuple[int, int, int]:
    if tokenizer is not None:
        return (tokenizer.vocab_size if vocab_size is None else vocab_size,
                tokenizer.bos_id if bos_id is None else bos_id,
                tokenizer.eos_id if eos_id is None else eos_id)
    if vocab_size is None or bos_id is None or eos_id is None:
        raise TinyLMError("give a tokenizer, or vocab_size, bos_id and eos_id")
    return vocab_size, bos_id, eos_id


def _check_settings(
    order: int, vocab_size: int, bos_id: int, eos_id: int, smoothing: str, k: float, discount: float | None
) -> None:
    if order < 1:
        raise TinyLMError(f"the order n must be 1 or more, got {order}")
    if not (0 <= bos_id < vocab_size and 0 <= eos_id < vocab_size) or bos_id == eos_id:
        raise TinyLMError(
            f"BOS ({bos_id}) and EOS ({eos_id}) must be two different ids below the vocabulary size {vocab_size}"
        )
    if smoothing not in SMOOTHINGS:
        raise TinyLMError(f"unknown smoothing {smoothing!r}; choose one of {', '.join(SMOOTHINGS)}")
    if smoothing == "add-k" and not k > 0:
        raise TinyLMError(f"add-k needs k > 0 (k = 0 is mle), got {k}")
    if discount is not None and not 0 < discount <= 1:
        raise TinyLMError(f"a Kneser-Ney discount must be in (0, 1], got {discount}")
    if smoothing == "kn-nltk" and order < 2:
        raise TinyLMError("nltk's Kneser-Ney formulation needs order 2 or more (its unigram level divides by zero)")
