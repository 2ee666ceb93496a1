"""Evaluation: loss, perplexity and bits per byte over a split, every token a target exactly once."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from tinylm.data import load_corpus, prepare
from tinylm.evaluate import evaluate, restrict, window_starts
from tinylm.model import GPT, GPTConfig
from tinylm.tokenizers import CharTokenizer

TEXT = ("Now is the winter of our discontent\nMade glorious summer by this sun of York;\n" * 3).strip()


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: more threads only wait on each other on a busy machine
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    folder = tmp_path_factory.mktemp("eval")
    corpus_dir = folder / "docs"
    corpus_dir.mkdir()
    for i in range(10):  # ten documents of different lengths, some with non-ASCII text (bytes != chars)
        (corpus_dir / f"d{i}.txt").write_text(TEXT[: 40 + 37 * i] + " ½ é ü", encoding="utf-8")
    corpus = load_corpus(corpus_dir)
    return prepare(corpus, CharTokenizer.train(corpus.texts()), folder / "shards", val_fraction=0.3)


class Unigram(nn.Module):
    """A model that ignores its context: the same distribution at every position."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.logits = nn.Parameter(torch.randn(vocab_size, generator=torch.Generator().manual_seed(0)))

    def forward(self, idx):
        return self.logits.expand(*idx.shape, -1)  # (B, T, |V|)


def test_every_token_of_the_split_is_a_target_once_and_bits_per_byte_is_the_formula(shards):
    model = Unigram(shards.vocab_size)
    data = np.asarray(shards.tokens("val"), dtype=np.int64)
    meta = shards.meta["splits"]["val"]
    logp = torch.log_softmax(model.logits.detach().double(), dim=-1).numpy()
    expected = -logp[data].sum()  # the first token and the short tail included
    for block_size, batch_size in [(16, 3), (7, 1), (len(data) + 5, 2)]:
        result = evaluate(model, shards, "val", block_size=block_size, batch_size=batch_size)
        assert result.tokens == len(data) == meta["tokens"] and not result.prorated
        assert result.loss_sum == pytest.approx(expected, rel=1e-6)
        assert result.loss == pytest.approx(expected / len(data), rel=1e-6)
        assert result.perplexity == pytest.approx(math.exp(result.loss))
        assert result.bytes == meta["bytes"]  # the UTF-8 bytes of the original text, not characters
        assert result.bits_per_byte == pytest.approx(result.loss * result.tokens / (meta["bytes"] * math.log(2)))


def test_gpt_evaluation_does_not_depend_on_the_batch_size(shards):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=shards.vocab_size, block_size=16, n_layer=1, d_model=16, n_head=2))
    a = evaluate(model, shards, "val", block_size=16, batch_size=1)
    b = evaluate(model, shards, "val", block_size=16, batch_size=64)
    assert a.loss == pytest.approx(b.loss, rel=1e-6)
    assert a.loss > 0 and 0 < a.bits_per_byte


def test_a_budget_evaluates_evenly_spaced_windows_and_prorates_the_bytes(shards):
    n = shards.num_tokens("val")
    starts = window_starts(n, 8, 24)
    assert len(starts) == 3 and (starts % 8 == 0).all()
    assert starts[0] == 0 and starts[-1] == (n // 8 - 1) * 8  # spread from the first full window to the last
    model = Unigram(shards.vocab_size)
    part = evaluate(model, shards, "val", block_size=8, batch_size=2, max_tokens=24)
    meta = shards.meta["splits"]["val"]
    assert part.prorated and part.tokens == 24
    assert part.bytes == pytest.approx(meta["bytes"] * 24 / meta["tokens"])
    assert part.bits_per_byte == pytest.approx(part.loss * 24 / (part.bytes * math.log(2)))
    # the same windows picked out of a whole-split evaluation give the same numbers
    whole = evaluate(model, shards, "val", block_size=8, batch_size=5)
    same = restrict(whole, starts, meta["tokens"], meta["bytes"])
    assert same.loss_sum == pytest.approx(part.loss_sum, rel=1e-9) and same.bytes == pytest.approx(part.bytes)
    assert window_starts(n, 8, 10 * n).tolist() == list(range(0, n, 8))  # a budget above the split: all of it
