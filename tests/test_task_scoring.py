"""Log-likelihood scoring (`tinylm.scoring`) and multiple-choice accuracy (`tinylm.task_eval.score_task`).

Known answers worked by hand: a bigram "network" whose next-token probabilities are set (two choices, where
accuracy and accuracy_norm per byte disagree), and a bigram counted by maximum likelihood. Then the fast paths
against the plain one: a Transformer reading each shared context once from a KV cache scores what it scores
reading every pair whole, and both what one forward pass of the pair gives; pairs too long for the window keep
their last block_size + 1 tokens. Every family scores a task as its own forward (or counts) say; the pair
splitting is lm-evaluation-harness's own ``_encode_pair``; the rolling log-likelihood is `tinylm eval`'s sum.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from tinylm.config import GPTConfig
from tinylm.data.mc_tasks import CHOICE, ChoiceItem, Task
from tinylm.errors import TinyLMError
from tinylm.evaluate import EvalText, evaluate_model
from tinylm.model import GPT, NGramLM, NGramModel, RecurrentLM
from tinylm.scoring import encode_pair, loglikelihoods, rolling_loglikelihood
from tinylm.task_eval import score_task
from tinylm.tokenizers import CharTokenizer

# ----- a bigram whose probabilities are set by hand --------------------------------------------------------------

EOS, A, B, SPACE = 0, 1, 2, 3
# P[current][next]: each row sums to one
P = torch.tensor([
    [0.10, 0.70, 0.10, 0.10],  # after EOS
    [0.10, 0.20, 0.20, 0.50],  # after "a"
    [0.05, 0.025, 0.90, 0.025],  # after "b"
    [0.10, 0.60, 0.20, 0.10],  # after " "
])


class SetBigram(nn.Module):
    """logits[t] = log P[x_t]: the next token depends on the current one alone, with probabilities we chose."""

    def __init__(self, block_size: int = 16) -> None:
        super().__init__()
        self.config = GPTConfig(vocab_size=4, block_size=block_size, n_layer=1, d_model=8, n_head=1)
        self.table = nn.Parameter(P.log(), requires_grad=False)

    def forward(self, idx: torch.Tensor, **_) -> tuple[torch.Tensor, None]:
        return self.table[idx], None  # (B, T, 4)


class Letters:
    """A tokenizer of the three characters "a", "b" and " ", with EOS 0."""

    eos_id = EOS
    ids = {"a": A, "b": B, " ": SPACE}

    def encode(self, text: str) -> list[int]:
        return [self.ids[c] for c in text]


def test_two_choices_worked_by_hand():
    short, long = " a", " bbbbbbb"
    # log p(" a" | "a") = log P[a][ ] + log P[ ][a] = log(0.5 * 0.6); log p(" bbbbbbb" | "a") = log(0.5 * 0.2 * 0.9^6)
    by_hand = [math.log(0.5 * 0.6), math.log(0.5 * 0.2 * 0.9 ** 6)]
    pairs = [encode_pair(Letters(), "a", choice, [EOS]) for choice in (short, long)]
    assert pairs[0] == ([EOS, A], [SPACE, A])
    scores = loglikelihoods(SetBigram(), pairs)
    assert [s for s, _ in scores] == pytest.approx(by_hand, abs=1e-6)
    assert [g for _, g in scores] == [True, False]  # " " then "a" are the argmax after "a" then " "; "b" is not
    # by the sum the short choice wins (-1.20 > -2.94); per byte the long one (-2.94 / 8 = -0.37 > -1.20 / 2 = -0.60)
    task = Task("hand", CHOICE, [ChoiceItem("a", (short, long), 1)], None)
    result = score_task(SetBigram(), Letters(), task, start_ids=[EOS])
    assert (result.accuracy, result.accuracy_norm) == (0.0, 1.0)
    task.test = [ChoiceItem("a", (short, long), 0)]
    result = score_task(SetBigram(), Letters(), task, start_ids=[EOS])
    assert (result.accuracy, result.accuracy_norm) == (1.0, 0.0)


def test_a_trailing_space_of_the_context_moves_to_the_choice():
    assert encode_pair(Letters(), "a ", "a", [EOS]) == ([EOS, A], [SPACE, A])
    assert encode_pair(Letters(), "", "ab", [EOS]) == ([EOS], [A, B])  # an empty context: the start token alone


def test_an_ngram_counted_by_hand():
    # documents "b a" and "b b a": after "b" came a, b, a (2/3, 1/3); after "a" always EOS; each opens with "b"
    ngram = NGramModel.fit([[B, A, EOS], [B, B, A, EOS]], 2, vocab_size=4, bos_id=3, eos_id=EOS, smoothing="mle")
    model = NGramLM(ngram, GPTConfig(family="ngram", vocab_size=4, block_size=8, order=2))
    scores = loglikelihoods(model, [([B], [A]), ([B], [B]), ([B], [A, EOS]), ([A, EOS], [B]), ([A, EOS, B], [B])])
    third = math.log(1 / 3)
    assert [s for s, _ in scores] == pytest.approx([math.log(2 / 3), third, math.log(2 / 3), 0.0, third])
    # after EOS a document starts afresh (p(b | start) = 1), though p(b | a) = 0
    assert [g for _, g in scores] == [True, False, True, True, False]


# ----- the fast paths against the plain one ----------------------------------------------------------------------


def reference(model: nn.Module, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    """One forward pass of the pair's last block_size + 1 tokens, the continuation's log-probabilities summed."""
    row = (context + continuation)[-(model.config.block_size + 1):]
    with torch.no_grad():
        logp = model(torch.tensor([row[:-1]]))[0][0].float().log_softmax(-1)  # (T, |V|)
    at = logp[len(row) - 1 - len(continuation):]
    target = torch.tensor(continuation)
    return float(at.gather(1, target[:, None]).sum()), bool((at.argmax(-1) == target).all())


def greedy(model: nn.Module, context: list[int], n: int) -> list[int]:
    """The ``n`` tokens greedy decoding writes after ``context`` (each step reads the last block_size tokens)."""
    ids = list(context)
    for _ in range(n):
        with torch.no_grad():
            ids.append(int(model(torch.tensor([ids[-model.config.block_size:]]))[0][0, -1].argmax()))
    return ids[len(context):]


def some_pairs(rng: np.random.Generator, vocab: int, block: int) -> list[tuple[list[int], list[int]]]:
    """Contexts shared by several continuations (as a question's choices are), lone ones, and some too long."""
    pairs = []
    for length in (1, 3, 9, 20, block - 2, block + 7):
        context = rng.integers(0, vocab, length).tolist()
        for n in (1, 2, 5):
            pairs.append((context, rng.integers(0, vocab, n).tolist()))
    pairs.append(([5], rng.integers(0, vocab, block).tolist()))  # the continuation fills the window
    return pairs


@pytest.mark.parametrize("settings", [{}, {"positions": "learned", "bigram_hash": 64, "qk_norm": True}],
                         ids=["rope", "learned-bigram"])
def test_a_shared_context_read_once_scores_what_each_pair_read_whole_does(settings):
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=40, block_size=24, n_layer=2, d_model=32, n_head=4, init_std=0.3, **settings)
    model = GPT(config).eval()
    pairs = some_pairs(np.random.default_rng(0), 40, 24)
    pairs += [(c, greedy(model, c, 3)) for c, _ in pairs[::6]]  # continuations the model would write
    shared = loglikelihoods(model, pairs, share_context=True, batch_size=3)
    whole = loglikelihoods(model, pairs, share_context=False, batch_size=3)
    by_one = [reference(model, c, x) for c, x in pairs]
    assert np.abs(np.array([s for s, _ in shared]) - [s for s, _ in by_one]).max() < 1e-4
    assert np.abs(np.array([s for s, _ in whole]) - [s for s, _ in by_one]).max() < 1e-4
    assert [g for _, g in shared] == [g for _, g in whole] == [g for _, g in by_one]
    assert any(g for _, g in by_one)  # some continuations are greedy: the flag is checked both ways
    assert loglikelihoods(model, pairs)[0][0] == pytest.approx(shared[0][0])  # a Transformer shares by default


def test_batches_do_not_change_the_scores():
    torch.manual_seed(1)
    model = GPT(GPTConfig(vocab_size=40, block_size=24, n_layer=1, d_model=16, n_head=2)).eval()
    pairs = some_pairs(np.random.default_rng(1), 40, 24)
    one = [s for s, _ in loglikelihoods(model, pairs, batch_size=1)]
    tokens = [s for s, _ in loglikelihoods(model, pairs)]  # about EVAL_BATCH_TOKENS a pass
    assert np.abs(np.array(one) - tokens).max() < 1e-4


def test_what_cannot_be_scored_is_one_line():
    model = SetBigram(block_size=4)
    assert loglikelihoods(model, [([A], [])]) == [(0.0, True)]  # log 1: nothing to predict
    with pytest.raises(TinyLMError, match="empty context"):
        loglikelihoods(model, [([], [A])])
    with pytest.raises(TinyLMError, match="does not fit the model's context of 4"):
        loglikelihoods(model, [([A], [A] * 5)])
    with pytest.raises(TinyLMError, match="batch_size must be positive"):
        loglikelihoods(model, [([A], [A])], batch_size=0)


# ----- every family ----------------------------------------------------------------------------------------------

TEXT = "the king rode to war while bells rang out over quiet fields and the queen of night sang"


@pytest.fixture(scope="module")
def tokenizer():
    return CharTokenizer.train([TEXT])


def models(tokenizer) -> dict[str, nn.Module]:
    torch.manual_seed(0)
    V = tokenizer.vocab_size
    out = {"gpt": GPT(GPTConfig(vocab_size=V, block_size=32, n_layer=2, d_model=32, n_head=4, init_std=0.3))}
    for family in ("lstm", "rnn"):
        out[family] = RecurrentLM(GPTConfig(family=family, vocab_size=V, block_size=32, n_layer=1, d_model=32,
                                            n_head=1))
    ngram = NGramModel.fit([tokenizer.encode(TEXT)], 3, tokenizer=tokenizer)
    out["ngram"] = NGramLM(ngram, GPTConfig(family="ngram", vocab_size=V, block_size=32, order=3))
    return {name: model.eval() for name, model in out.items()}


def choice_task() -> Task:
    words = ["king", "queen", "night", "war", "bells"]
    items = [ChoiceItem(f"the {w} rode", tuple(f" {x}" for x in ("to war", "out over", "and sang")), i % 3)
             for i, w in enumerate(words)]
    return Task("families", CHOICE, items, None, 1 / 3)


@pytest.mark.parametrize("family", ["gpt", "lstm", "rnn", "ngram"])
def test_every_family_scores_a_task_as_its_own_probabilities_say(family, tokenizer):
    model = models(tokenizer)[family]
    task = choice_task()
    start = [tokenizer.eos_id]
    right = right_norm = 0
    for item in task.test:
        lls = []
        for choice in item.choices:
            context, continuation = encode_pair(tokenizer, item.context, choice, start)
            if family == "ngram":  # the counts themselves, token by token
                whole = context + continuation
                lls.append(sum(model.ngram.logprob(whole[:len(context) + k], t) for k, t in enumerate(continuation)))
            else:
                lls.append(reference(model, context, continuation)[0])
        lengths = [len(c.encode()) for c in item.choices]
        right += int(np.argmax(lls)) == item.answer
        right_norm += int(np.argmax(np.array(lls) / lengths)) == item.answer
    result = score_task(model, tokenizer, task, start_ids=start)
    assert (result.correct, result.correct_norm, result.n) == (right, right_norm, 5)


@pytest.mark.parametrize("family", ["gpt", "lstm", "ngram"])
def test_the_rolling_log_likelihood_is_tinylm_eval_s(family, tokenizer):
    model = models(tokenizer)[family]
    ids = tokenizer.encode(TEXT * 2) + [tokenizer.eos_id]  # longer than one window of 32
    text = EvalText("text", np.array(ids), len(TEXT) * 2)
    result = evaluate_model(model, text, tokenizer, block_size=32)
    assert rolling_loglikelihood(model, [tokenizer.eos_id] + ids) == pytest.approx(-result.loss_sum, rel=1e-9)


# ----- the pair split against lm-evaluation-harness's own ---------------------------------------------------------


def test_pairs_split_as_lm_eval_s_encode_pair():
    lm_model = pytest.importorskip("lm_eval.api.model")
    from tinylm.tokenizers import train_bpe

    bpe = train_bpe([TEXT * 3, "To be, or not to be: that is the question.\n\nROMEO.\nGood morrow."], vocab_size=300,
                    pattern="gpt4", workers=1)
    start = [bpe.eos_id]

    class Encoder(lm_model.TemplateLM):  # only what _encode_pair reads
        backend = "causal"

        def tok_encode(self, text, **_):
            return start + bpe.encode(text)

        eot_token_id = _loglikelihood_tokens = loglikelihood_rolling = generate_until = None

    oracle = Encoder.__new__(Encoder)
    for context, continuation in [("To be, or not to", " be"), ("To be, or not to ", "be"), ("ROMEO.\n", "Good"),
                                  ("the king  ", " rode"), ("Good morrow.\n\n", "ROMEO."), ("question", ".")]:
        assert encode_pair(bpe, context, continuation, start) == oracle._encode_pair(context, continuation)
