"""Beam search: it finds the best path where greedy does not, normalises by length, and its cache is exact."""

from __future__ import annotations

import math

import pytest
import torch

from tinylm.generate.beam import beam_search
from tinylm.generate.engine import Engine, generate
from tinylm.generate.sampling import SamplingParams

from toys import BigramLM, tiny_gpt


def chain(V: int, transitions: dict[int, dict[int, float]]) -> BigramLM:
    """A Markov chain: transitions[a][b] = p(b | a); unlisted rows are uniform."""
    probs = torch.full((V, V), 1.0 / V)
    for a, row in transitions.items():
        probs[a] = 0.0
        for b, p in row.items():
            probs[a, b] = p
    return BigramLM(probs)


S, A, B, C, D, E, EOS = range(7)
# From the start S, A looks best (0.6 > 0.4), but after A the model is unsure (0.4, 0.3, 0.3),
# while B leads to E with 0.9: the best two-token path is B E (0.36), not greedy's A C (0.24).
TRAP = {S: {A: 0.6, B: 0.4}, A: {C: 0.4, D: 0.3, E: 0.3}, B: {E: 0.9, C: 0.05, D: 0.05},
        C: {EOS: 1.0}, D: {EOS: 1.0}, E: {EOS: 1.0}}


def test_beam_search_finds_the_best_path_where_greedy_does_not():
    model = chain(7, TRAP)
    greedy = Engine(model, SamplingParams(max_new_tokens=5, temperature=0, stop_ids=[EOS])).generate([[S]])[0]
    assert greedy.token_ids == [A, C, EOS]
    assert math.isclose(sum(greedy.logprobs), math.log(0.6 * 0.4), abs_tol=1e-5)

    beams = beam_search(model, [S], num_beams=2, max_new_tokens=5, stop_ids=[EOS])
    assert beams[0].tokens == [B, E, EOS] and beams[0].stop == EOS
    assert math.isclose(beams[0].logprob, math.log(0.4 * 0.9), abs_tol=1e-5)
    assert beams[1].logprob <= beams[0].logprob
    # one beam is greedy decoding
    assert beam_search(model, [S], num_beams=1, max_new_tokens=5, stop_ids=[EOS])[0].tokens == [A, C, EOS]


# A short path X EOS with probability 0.5 against a long one Y Z W EOS with 0.5 * 0.9 * 0.9 = 0.405:
# the raw sum prefers the short one; per token the long one is better (log 0.405 / 4 > log 0.5 / 2).
S2, X, Y, Z, W, EOS2 = range(6)
LENGTHS = {S2: {X: 0.5, Y: 0.5}, X: {EOS2: 1.0}, Y: {Z: 0.9, W: 0.1}, Z: {W: 0.9, EOS2: 0.1}, W: {EOS2: 1.0}}


@pytest.mark.parametrize("length_penalty, best", [(0.0, [X, EOS2]), (1.0, [Y, Z, W, EOS2])])
def test_length_normalisation_changes_which_finished_path_wins(length_penalty, best):
    beams = beam_search(chain(6, LENGTHS), [S2], num_beams=2, max_new_tokens=6, stop_ids=[EOS2],
                        length_penalty=length_penalty)
    assert beams[0].tokens == best
    scores = [b.score(length_penalty) for b in beams]
    assert scores == sorted(scores, reverse=True)


@pytest.mark.parametrize("positions", ["learned", "rope"])
def test_cached_beam_search_equals_recomputing_every_beam(positions):
    model = tiny_gpt(positions=positions, n_kv_head=2)
    kwargs = dict(num_beams=3, max_new_tokens=25, stop_ids=[7])
    cached = beam_search(model, [1, 2, 3, 4], **kwargs)
    naive = beam_search(model, [1, 2, 3, 4], use_cache=False, **kwargs)
    assert [b.tokens for b in cached] == [b.tokens for b in naive]
    torch.testing.assert_close(torch.tensor([b.logprob for b in cached]), torch.tensor([b.logprob for b in naive]),
                               atol=1e-5, rtol=0)


def test_cached_beam_search_with_a_sliding_window_equals_recomputing_every_beam():
    model = tiny_gpt(positions="rope", n_kv_head=2, sliding_window=5)
    kwargs = dict(num_beams=3, max_new_tokens=25)
    cached = beam_search(model, [1, 2, 3, 4], **kwargs)
    assert [b.tokens for b in cached] == [b.tokens for b in beam_search(model, [1, 2, 3, 4], use_cache=False,
                                                                        **kwargs)]


def test_beam_search_across_the_context_window_equals_recomputing():
    model = tiny_gpt(positions="learned", block_size=16)
    with pytest.warns(UserWarning, match="context"):
        cached = beam_search(model, [1, 2, 3], num_beams=3, max_new_tokens=30, keep=8)
    with pytest.warns(UserWarning, match="context"):
        naive = beam_search(model, [1, 2, 3], num_beams=3, max_new_tokens=30, keep=8, use_cache=False)
    assert [b.tokens for b in cached] == [b.tokens for b in naive] and len(cached[0].tokens) == 30


def test_one_beam_is_greedy_decoding_on_a_gpt():
    model = tiny_gpt(positions="rope")
    beam = beam_search(model, [5, 6, 7], num_beams=1, max_new_tokens=30)[0]
    greedy = Engine(model, SamplingParams(max_new_tokens=30, temperature=0)).generate([[5, 6, 7]])[0]
    assert beam.tokens == greedy.token_ids


def test_generate_with_beams_returns_the_best_num_samples_paths(byte_tokenizer):
    model = tiny_gpt(vocab_size=byte_tokenizer.vocab_size)
    params = SamplingParams(num_beams=4, num_samples=2, max_new_tokens=6, length_penalty=1.0)
    out = generate(model, byte_tokenizer, ["ab", "c"], params)
    assert [(c.prompt_index, c.sample_index) for c in out] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for first, second in (out[0:2], out[2:4]):
        assert first.token_ids != second.token_ids
        assert sum(first.logprobs) / len(first.logprobs) >= sum(second.logprobs) / len(second.logprobs)
        assert first.finish_reason in ("stop", "length")
