"""The n-gram model behind the neural models' interface: the same engine samples it, and what it
computes is the counted model's distribution."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tinylm.config import GPTConfig
from tinylm.generate.beam import beam_search
from tinylm.generate.engine import Engine
from tinylm.generate.sampling import SamplingParams
from tinylm.model import NGramLM, NGramModel


def random_stream(seed: int, n_docs: int = 60, n_words: int = 8) -> tuple[np.ndarray, int, int, int]:
    rng = np.random.default_rng(seed)
    bos, eos, vocab = n_words, n_words + 1, n_words + 3
    docs = [np.append(rng.integers(0, n_words, size=rng.integers(1, 12)), eos) for _ in range(n_docs)]
    return np.concatenate(docs), bos, eos, vocab


@pytest.fixture(scope="module")
def lm() -> NGramLM:
    stream, bos, eos, vocab = random_stream(seed=3)
    ngram = NGramModel.fit(stream, 3, vocab_size=vocab, bos_id=bos, eos_id=eos, smoothing="kn")
    return NGramLM(ngram, GPTConfig(family="ngram", vocab_size=vocab, block_size=64, order=3))


def test_logits_are_the_counted_distribution_without_bos(lm):
    idx = torch.tensor([[1, 2, 3, 9, 4, 5]])  # 9 is EOS: the context restarts after it
    logits, _ = lm(idx)
    ids = idx[0].tolist()
    for t in range(len(ids)):
        expected = lm.ngram.next_token_distribution(ids[: t + 1])
        got = logits[0, t].exp().double().numpy()
        assert got[lm.ngram.bos_id] == 0.0  # BOS is padding, never text
        expected[lm.ngram.bos_id] = 0.0
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-12)


def test_greedy_engine_equals_the_counted_model_greedy_sampler(lm):
    for prompt in ([9], [9, 1, 2], [9, 5, 5, 5]):
        (completion,) = Engine(lm, SamplingParams(max_new_tokens=25, temperature=0)).generate([prompt])
        expected = lm.ngram.sample(prompt, 25, temperature=0)
        assert completion.token_ids[: len(expected)] == expected
        if len(expected) < 25:  # the counted sampler stops before EOS; the engine keeps the EOS it stopped on
            assert completion.token_ids[len(expected)] == lm.ngram.eos_id


def test_batches_with_padding_and_sampling_filters(lm):
    prompts = [[9, 1], [9, 2, 3, 4, 5, 6], [9]]
    greedy = SamplingParams(max_new_tokens=10, temperature=0)
    together = Engine(lm, greedy).generate(prompts)
    alone = [Engine(lm, greedy).generate([p])[0] for p in prompts]
    assert [c.token_ids for c in together] == [c.token_ids for c in alone]
    params = SamplingParams(max_new_tokens=40, temperature=1.5, top_k=2, seed=11, num_samples=3, stop_ids=[])
    a, b = Engine(lm, params).generate(prompts), Engine(lm, params).generate(prompts)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    for completion in a:  # each token is among the two most likely after its context
        history = prompts[completion.prompt_index] + completion.token_ids
        start = len(prompts[completion.prompt_index])
        for t, token in enumerate(completion.token_ids):
            p = lm.ngram.next_token_distribution(history[: start + t])
            p[lm.ngram.bos_id] = 0
            assert p[token] >= np.sort(p)[-2] - 1e-12  # (a token tied with the second is kept too)


def test_beam_search_runs_over_the_token_history(lm):
    beams = beam_search(lm, [9, 1], 3, 8, stop_ids=[lm.ngram.eos_id])
    assert len(beams) == 3
    # with and without the history cache: the same beams
    assert [b.tokens for b in beams] == [b.tokens for b in beam_search(lm, [9, 1], 3, 8, stop_ids=[lm.ngram.eos_id],
                                                                       use_cache=False)]
    scores = []
    for beam in beams:
        history, total = [9, 1], 0.0
        for token in beam.tokens:
            p = lm.ngram.next_token_distribution(history)
            p[lm.ngram.bos_id] = 0.0  # generation's distribution: BOS left out, the rest renormalised
            total += float(np.log(p[token] / p.sum()))
            history.append(token)
        scores.append(total)
        assert total == pytest.approx(beam.logprob, abs=1e-4)
