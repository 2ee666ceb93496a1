"""The n-gram model behind the neural models' interface: the same engine samples it, and what it
computes is the counted model's distribution. The counted model has no sampler of its own, so its
sampling (seeds, temperature, top-k, top-p, BOS never drawn) is tested here, through the engine."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tinylm.config import GPTConfig
from tinylm.generate.beam import beam_search
from tinylm.generate.engine import Engine
from tinylm.generate.sampling import SamplingParams, sampling_distribution
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


def counted_greedy(ngram: NGramModel, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy decoding by the definition: the most likely token after the whole history (BOS, padding, is never
    text), until EOS (left out) or the token limit."""
    history, new = list(prompt), []
    for _ in range(max_new_tokens):
        p = ngram.next_token_distribution(history)
        p[ngram.bos_id] = 0.0
        token = int(np.argmax(p))
        if token == ngram.eos_id:
            break
        history.append(token)
        new.append(token)
    return new


def test_greedy_engine_equals_the_counted_model_greedy_sampler(lm):
    for prompt in ([9], [9, 1, 2], [9, 5, 5, 5]):
        (completion,) = Engine(lm, SamplingParams(max_new_tokens=25, temperature=0)).generate([prompt])
        expected = counted_greedy(lm.ngram, prompt, 25)
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


# ----- sampling a counted model, through the engine ----------------------------------------------


@pytest.fixture(scope="module")
def sampler() -> NGramLM:
    stream, bos, eos, vocab = random_stream(seed=5)
    ngram = NGramModel.fit(stream, 3, vocab_size=vocab, bos_id=bos, eos_id=eos, smoothing="kn")
    return NGramLM(ngram, GPTConfig(family="ngram", vocab_size=vocab, block_size=64, order=3))


def draw(lm: NGramLM, prompt: list[int], max_new_tokens: int, **params) -> list[int]:
    """One sample's new tokens, EOS ending it (and left out, as a stop token's text is)."""
    eos = lm.ngram.eos_id
    params = SamplingParams(max_new_tokens=max_new_tokens, stop_ids=[eos], **params)
    (completion,) = Engine(lm, params).generate([prompt])
    tokens = completion.token_ids
    return tokens[:-1] if completion.stop == eos else tokens


def drawable(ngram: NGramModel, history: list[int]) -> np.ndarray:
    """The counted distribution after ``history`` with BOS left out: what a sampler draws from."""
    p = ngram.next_token_distribution(history)
    p[ngram.bos_id] = 0.0
    return p


def test_sampling_is_reproducible_with_a_seed(sampler):
    a = draw(sampler, [1, 2], 40, temperature=1.2, seed=123)
    assert a == draw(sampler, [1, 2], 40, temperature=1.2, seed=123)
    draws = {tuple(draw(sampler, [1, 2], 40, temperature=1.2, seed=s)) for s in range(5)}
    assert len(draws) > 1  # the seed matters
    assert sampler.ngram.eos_id not in a  # EOS ends a sample and is not part of it
    # BOS is padding, never drawn, even from a model that gives it real mass (add-k's near-uniform)
    flat = NGramLM(sampler.ngram.with_smoothing("add-k", k=100.0), sampler.config)
    assert flat.ngram.next_token_distribution([1, 2])[flat.ngram.bos_id] > 0.05
    drawn = [t for seed in range(40) for t in draw(flat, [1, 2], 50, seed=seed)]  # EOS ends each early
    assert len(drawn) > 200 and flat.ngram.bos_id not in drawn


def test_sampling_respects_top_k_and_top_p(sampler):
    ngram, prompt = sampler.ngram, [3, 1]
    for k in (1, 2, 3):
        out = draw(sampler, prompt, 30, top_k=k, seed=k)
        history = list(prompt)
        for t in out:
            p = drawable(ngram, history)
            assert p[t] >= np.sort(p)[-k] * (1 - 1e-6)  # among the k most likely (ties with the k-th allowed;
            history.append(t)                           # the engine's logits are float32)
    # top-k 1 and temperature 0 are both greedy decoding
    assert draw(sampler, prompt, 20, top_k=1, seed=0) == draw(sampler, prompt, 20, temperature=0)
    out = draw(sampler, prompt, 30, top_p=0.3, seed=1)
    history = list(prompt)
    for t in out:
        with np.errstate(divide="ignore"):
            logits = torch.from_numpy(np.log(drawable(ngram, history))).float()[None]  # (1, V), as NGramLM gives
        assert sampling_distribution(logits, SamplingParams(top_p=0.3))[0, t] > 0  # inside the nucleus
        history.append(t)
