"""The naive sampler `train` uses for its closing sample: greedy, seeded, top-k, EOS, the context window."""

from __future__ import annotations

import torch

from tinylm.generate.naive import generate_naive, next_token_distribution
from tinylm.model import GPT, GPTConfig


def model(block_size: int = 8) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=20, block_size=block_size, n_layer=1, d_model=16, n_head=2)).eval()


def test_temperature_zero_is_greedy_and_recomputes_the_window():
    m = model(block_size=8)
    out = generate_naive(m, [1, 2, 3], 12, temperature=0)  # runs past the 8-token context
    tokens = [1, 2, 3]
    for _ in range(12):  # the definition, by hand: argmax of the last position over the last 8 tokens
        logits, _ = m(torch.tensor([tokens[-8:]]))
        tokens.append(int(logits[0, -1].argmax()))
    assert out == tokens[3:]


def test_a_seed_reproduces_the_draw_and_top_k_1_is_greedy():
    m = model()
    a = generate_naive(m, [4], 10, temperature=1.0, seed=3)
    assert a == generate_naive(m, [4], 10, temperature=1.0, seed=3)
    assert generate_naive(m, [4], 10, temperature=1.0, top_k=1, seed=9) == generate_naive(m, [4], 10, temperature=0)
    probs = next_token_distribution(torch.tensor([1.0, 3.0, 2.0, 0.0]), temperature=1.0, top_k=2)
    assert probs[0] == 0 and probs[3] == 0 and abs(float(probs.sum()) - 1) < 1e-6


def test_generation_stops_at_eos():
    m = model()
    greedy = generate_naive(m, [5], 6, temperature=0)
    eos = greedy[2]  # pretend the third greedy token is EOS: generation stops before it
    assert generate_naive(m, [5], 6, temperature=0, eos_id=eos) == greedy[: greedy.index(eos)]
