"""Inspection: the next-token candidates at a temperature, side by side temperatures, attention maps."""

from __future__ import annotations

import math

import pytest
import torch

from tinylm.generate.engine import Engine
from tinylm.generate.inspect import (
    attention_maps,
    format_candidates,
    left_out,
    next_token_candidates,
    next_token_logits,
    temperature_table,
)
from tinylm.generate.sampling import SamplingParams

from toys import BigramLM, tiny_gpt


@pytest.fixture
def after_a(byte_tokenizer) -> BigramLM:
    """After "a" the next byte is b, c or d with probabilities 0.5, 0.3, 0.2."""
    V = byte_tokenizer.vocab_size
    probs = torch.full((V, V), 1.0 / V)
    probs[ord("a")] = 0.0
    probs[ord("a"), [ord("b"), ord("c"), ord("d")]] = torch.tensor([0.5, 0.3, 0.2])
    return BigramLM(probs)


def test_candidates_are_the_most_likely_tokens_with_their_probabilities(after_a, byte_tokenizer):
    top = next_token_candidates(after_a, byte_tokenizer, byte_tokenizer.encode("xa"), top=3)
    assert [(c.token_id, c.text) for c in top] == [(98, "b"), (99, "c"), (100, "d")]
    torch.testing.assert_close(torch.tensor([c.probability for c in top]), torch.tensor([0.5, 0.3, 0.2]))


def test_temperature_reshapes_the_candidates_without_reordering_them(after_a, byte_tokenizer):
    ids = byte_tokenizer.encode("a")
    candidates, table = temperature_table(after_a, byte_tokenizer, ids, [0.0, 0.5, 1.0, 2.0], top=3)
    probs = torch.tensor(table)  # (3 candidates, 4 temperatures)
    p = torch.tensor([0.5, 0.3, 0.2])
    torch.testing.assert_close(probs[:, 0], torch.tensor([1.0, 0.0, 0.0]))  # greedy
    torch.testing.assert_close(probs[:, 1], p**2 / (p**2).sum())  # tau = 1/2 squares the probabilities
    torch.testing.assert_close(probs[:, 2], p)
    # tau = 2 takes square roots, which lifts the 256 other tokens' 1e-12 to 1e-6 each: normalise over all
    full = after_a.table[ord("a")].exp()  # (V,)
    torch.testing.assert_close(probs[:, 3], (full.sqrt() / full.sqrt().sum())[[98, 99, 100]])
    text = format_candidates(candidates, [0.0, 0.5, 1.0, 2.0], table)
    assert text.splitlines()[0].split() == ["rank", "id", "token", "T=0", "T=0.5", "T=1", "T=2"]
    assert text.splitlines()[1].split()[:3] == ["1", "98", "'b'"]


def test_the_top_candidate_is_what_greedy_decoding_picks():
    model = tiny_gpt(vocab_size=259)
    from tinylm.tokenizers import BPETokenizer

    tok = BPETokenizer([], pattern="gpt2")
    ids = tok.encode("hello")
    first = Engine(model, SamplingParams(max_new_tokens=1, temperature=0)).generate([ids])[0].token_ids[0]
    assert next_token_candidates(model, tok, ids, top=1)[0].token_id == first


def test_a_prompt_longer_than_the_context_is_read_through_its_last_window():
    model = tiny_gpt(block_size=16, positions="learned")
    ids = list(range(40))
    with pytest.warns(UserWarning, match="the prompt is 40 tokens, longer than the model's context of 16: keeping "
                      "its last 16 tokens"):
        long = next_token_logits(model, ids)
    torch.testing.assert_close(long, next_token_logits(model, ids[-16:]))


def test_attention_maps_are_causal_distributions():
    model = tiny_gpt(n_layer=2, n_head=4)
    maps = attention_maps(model, [1, 2, 3, 4, 5, 6])
    assert len(maps) == 2 and maps[0].shape == (4, 6, 6)
    for w in maps:
        torch.testing.assert_close(w.sum(-1), torch.ones(4, 6))
        assert torch.all(w.triu(diagonal=1) == 0)  # nothing attends to the future


def test_candidates_are_the_tokens_a_sample_can_take_with_the_probabilities_it_draws_with():
    """A model that puts most of its mass on PAD and BOS: they are not candidates (no sampler draws them), and the
    probabilities shown are renormalised over the rest, as the engine's logprobs are."""
    from tinylm.tokenizers import CharTokenizer
    from tinylm.tokenizers.base import generation_excluded

    tok = CharTokenizer.train(["abc"])
    never = generation_excluded(tok)
    probs = torch.full((tok.vocab_size, tok.vocab_size), 1.0)
    probs[:, never] = 30.0
    probs[:, tok.encode("b")[0]] = 2.0
    model = BigramLM(probs / probs.sum(-1, keepdim=True))
    ids = tok.encode("a")
    shown = next_token_candidates(model, tok, ids, top=tok.vocab_size)
    assert {c.token_id for c in shown} == set(range(tok.vocab_size)) - set(never)
    assert sum(c.probability for c in shown) == pytest.approx(1.0)
    assert shown[0].token_id == tok.encode("b")[0] and shown[0].probability == pytest.approx(2 / (2 + len(shown) - 1))
    hidden = left_out(model, tok, ids)  # what was left out, at the model's own probabilities
    assert [i for i, _ in hidden] and {i for i, _ in hidden} == set(never)
    assert sum(p for _, p in hidden) == pytest.approx(float(probs[ids[-1], never].sum() / probs[ids[-1]].sum()))
    [drawn] = Engine(model, SamplingParams(max_new_tokens=1, temperature=0), tok).generate([ids])
    assert drawn.token_ids == [shown[0].token_id]
    assert drawn.logprobs[0] == pytest.approx(math.log(shown[0].probability))
