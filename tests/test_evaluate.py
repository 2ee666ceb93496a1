"""Evaluation: loss, perplexity and bits per byte over a split, every token a target exactly once."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from tinylm.data import load_corpus, prepare
from tinylm.errors import TinyLMError
from tinylm.evaluate import evaluate, evaluate_model, evaluate_run, evaluate_tokens, restrict, split_text, window_starts
from tinylm.model import GPT, GPTConfig, NGramLM, NGramModel, build_model
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


# ----- sliding windows ---------------------------------------------------------------------------


def tiny_network(family: str, vocab_size: int, block_size: int) -> nn.Module:
    torch.manual_seed(0)
    config = GPTConfig(family=family, vocab_size=vocab_size, block_size=block_size, n_layer=1, d_model=16,
                       n_head=2)
    return build_model(config).eval()


@torch.no_grad()
def sliding_by_hand(model: nn.Module, data: np.ndarray, eos: int, block_size: int, stride: int) -> dict[int, float]:
    """-log p of every target, window by window, from the definition: target t is scored by the first window
    that holds it, window j holding targets j*stride .. j*stride + block_size - 1, and it is predicted from
    that window's tokens up to it (an EOS before the first token of the split)."""
    stream = np.concatenate(([eos], data))  # stream[t] is the token just before target t
    sums: dict[int, float] = {}
    for t in range(len(data)):
        j = max(0, math.ceil((t - block_size + 1) / stride))  # the first window with j*stride + block_size > t
        start = j * stride
        assert start <= t < start + block_size and t - start + 1 >= min(t + 1, block_size - stride + 1)
        x = torch.tensor(stream[start : t + 1]).unsqueeze(0)  # (1, t - start + 1)
        out = model(x)
        logits = out[0] if isinstance(out, tuple) else out  # (1, T, |V|)
        logp = torch.log_softmax(logits[0, -1].double(), dim=-1)
        sums[start] = sums.get(start, 0.0) - float(logp[data[t]])
    return sums


@pytest.mark.parametrize("family", ["gpt", "lstm", "rnn"])
@pytest.mark.parametrize("block_size,stride", [(8, 3), (8, 1), (8, 7), (5, 5)])
def test_sliding_windows_score_each_target_as_a_loop_over_its_window_does(shards, family, block_size, stride):
    model = tiny_network(family, shards.vocab_size, block_size)
    data = np.asarray(shards.tokens("val"), dtype=np.int64)[:29]  # short: 29 is no multiple of any stride here
    result = evaluate_tokens(model, data, 100, shards.eos_id, block_size=block_size, stride=stride, batch_size=2)
    expected = sliding_by_hand(model, data, shards.eos_id, block_size, stride)
    assert result.window_starts.tolist() == sorted(expected)
    torch.testing.assert_close(torch.from_numpy(result.window_losses),
                               torch.tensor(list(expected.values()), dtype=torch.float64), rtol=1e-5, atol=1e-5)
    assert result.tokens == len(data) and not result.prorated
    assert result.window_tokens[0] == block_size and (result.window_tokens[1:-1] == stride).all()


def test_stride_block_size_is_the_disjoint_evaluation_bit_for_bit(shards):
    model = tiny_network("gpt", shards.vocab_size, 16)
    for max_tokens in (0, 40):  # all of it (with the short tail window), and a budget
        default = evaluate(model, shards, "val", block_size=16, batch_size=3, max_tokens=max_tokens)
        same = evaluate(model, shards, "val", block_size=16, batch_size=3, max_tokens=max_tokens, stride=16)
        assert same.loss_sum == default.loss_sum and same.bits_per_byte == default.bits_per_byte
        for field in ("window_starts", "window_losses", "window_tokens"):
            assert np.array_equal(getattr(same, field), getattr(default, field))
        assert {**same.report(), "seconds": 0} == {**default.report(), "seconds": 0}
        assert default.report()["windows"] == "disjoint" and default.report()["stride"] == 16


def test_any_stride_scores_every_target_once(shards):
    # a model that ignores its context gives each target the same -log p whatever window it is read in, so
    # the sum over the split is the same for every stride only if every target is scored exactly once
    model = Unigram(shards.vocab_size)
    data = np.asarray(shards.tokens("val"), dtype=np.int64)
    logp = torch.log_softmax(model.logits.detach().double(), dim=-1).numpy()
    meta = shards.meta["splits"]["val"]
    for block_size in (16, 7, len(data), len(data) + 5):
        for stride in sorted({1, 2, 5, block_size - 1, block_size} - {0}):
            result = evaluate(model, shards, "val", block_size=block_size, batch_size=4, stride=stride)
            assert result.tokens == int(result.window_tokens.sum()) == len(data) == meta["tokens"]
            assert result.loss_sum == pytest.approx(-logp[data].sum(), rel=1e-6)
            assert not result.prorated and result.bytes == meta["bytes"]  # each target's bytes counted once
            assert result.windows == ("disjoint" if stride == block_size else "sliding")


def test_the_stride_is_checked_against_the_block_size(shards):
    model = Unigram(shards.vocab_size)
    for stride in (0, -3, 17):
        with pytest.raises(TinyLMError, match=rf"stride {stride} is out of range: give 1 to 16, the block_size"):
            evaluate(model, shards, "val", block_size=16, stride=stride)


def test_a_budget_with_a_stride_takes_evenly_spaced_windows_of_stride_targets(shards):
    model = tiny_network("gpt", shards.vocab_size, 8)
    meta = shards.meta["splits"]["val"]
    n = meta["tokens"]
    starts = window_starts(n, 8, 30, stride=3)
    assert len(starts) == 10 and starts[0] == 3 and (starts % 3 == 0).all() and (starts + 8 <= n).all()
    part = evaluate(model, shards, "val", block_size=8, batch_size=4, max_tokens=30, stride=3)
    assert part.prorated and part.tokens == 30 and (part.window_tokens == 3).all()
    assert part.bytes == pytest.approx(meta["bytes"] * 30 / n)
    whole = evaluate(model, shards, "val", block_size=8, batch_size=4, stride=3)
    same = restrict(whole, starts, n, meta["bytes"])
    assert same.loss_sum == pytest.approx(part.loss_sum, rel=1e-6) and same.tokens == 30
    # a split too short for a window of stride targets: the budget can only take all of it
    assert window_starts(10, 8, 4, stride=3).tolist() == [0, 3] and window_starts(5, 8, 3).tolist() == [0]


def test_an_ngram_model_is_scored_the_same_whatever_the_stride(shards):
    ngram = NGramModel.fit_shards(shards, 3)
    model = NGramLM(ngram, GPTConfig(family="ngram", vocab_size=ngram.vocab_size, block_size=16, order=3))
    text, tok = split_text(shards, "val"), shards.tokenizer()
    default = evaluate_model(model, text, tok, block_size=16)
    for stride in (1, 16, 1000):  # no windows: not bounded by a block_size either
        result = evaluate_model(model, text, tok, block_size=16, stride=stride)
        assert result.loss_sum == default.loss_sum and result.tokens == default.tokens
        assert result.report()["windows"] == "none" and result.report()["stride"] is None
    with pytest.raises(TinyLMError, match="stride 0 is out of range: give a positive integer"):
        evaluate_model(model, text, tok, block_size=16, stride=0)


def test_an_ngram_model_scores_into_the_same_result_as_the_networks(shards):
    ngram = NGramModel.fit_shards(shards, 3)
    model = NGramLM(ngram, GPTConfig(family="ngram", vocab_size=ngram.vocab_size, block_size=16, order=3))
    via_engine = evaluate_model(model, split_text(shards, "val"), shards.tokenizer(), block_size=16)
    own = ngram.evaluate_shards(shards, "val")
    assert type(own) is type(via_engine) is type(evaluate(Unigram(shards.vocab_size), shards, block_size=16))
    assert {**own.report(), "seconds": 0} == {**via_engine.report(), "seconds": 0}  # no <unk> in this text
    assert own.as_dict() == via_engine.as_dict() and own.describe_windows() == "an n-gram's own context, no windows"


def test_evaluation_shows_progress_and_batches_by_tokens(capsys):
    from tinylm.evaluate import EVAL_BATCH_TOKENS, eval_batch_size, evaluate_tokens

    assert eval_batch_size(128) == EVAL_BATCH_TOKENS // 128 and eval_batch_size(10**6) == 1
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50, block_size=16, n_layer=1, d_model=16, n_head=2))
    data = np.random.default_rng(0).integers(0, 49, 500)
    quiet = evaluate_tokens(model, data, 1000, 49, block_size=16, batch_size=4)
    assert "evaluating" not in capsys.readouterr().err
    shown = evaluate_tokens(model, data, 1000, 49, block_size=16, batch_size=4, progress=True)
    assert "evaluating val" in capsys.readouterr().err
    assert shown.loss == quiet.loss


def test_a_split_and_a_corpus_together_are_refused_by_the_library_as_by_the_command(tmp_path, capsys):
    from tinylm.cli import main
    from tinylm.compare import compare_runs

    with pytest.raises(TinyLMError, match=r"^--split picks a split of the run's shards; --corpus evaluates"):
        evaluate_run(tmp_path / "no-run", "train", corpus="shakespeare")
    with pytest.raises(TinyLMError, match=r"^--split picks a split of each run's shards"):
        compare_runs([tmp_path / "a", tmp_path / "b"], split="train", corpus="shakespeare")
    assert main(["eval", "--run", str(tmp_path / "no-run"), "--split", "train", "--corpus", "shakespeare"]) == 2
    assert "--split picks a split of the run's shards" in capsys.readouterr().err
