"""Tiny random GPTs and two toy models whose outputs we choose, for the generation tests.

The toys follow the model's calling convention (``forward(idx, attention_mask=None,
position_ids=None, kv_cache=None) -> (logits, None)``, a ``config`` with the sizes a KV cache
needs) so the real engine and beam search run on them unchanged:

- `BigramLM`: the next-token logits depend on the last token only, through a table we write:
  a Markov chain whose best paths can be worked out by hand.
- `ScriptedLM`: strongly predicts ``script[p + 1]`` at position p: it "says" a fixed text, so
  stop strings and streaming can be tested on known token boundaries.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from tinylm.config import GPTConfig
from tinylm.model import GPT


def tiny_config(**changes) -> GPTConfig:
    """2 layers, d = 32, 4 heads: small enough to run hundreds of steps in well under a second."""
    base = GPTConfig(vocab_size=97, block_size=128, n_layer=2, d_model=32, n_head=4, n_kv_head=None,
                     mlp="swiglu", norm="rmsnorm", positions="rope", bias=False, init_std=0.25)
    return dataclasses.replace(base, **changes)


def tiny_gpt(seed: int = 0, **changes) -> GPT:
    """A random GPT whose greedy continuations vary (init_std 0.25: with GPT-2's 0.02 the logits are
    nearly flat and greedy decoding repeats one token, which would make equality tests too easy)."""
    torch.manual_seed(seed)
    return GPT(tiny_config(**changes)).eval()


class _ToyLM(nn.Module):
    """Common parts of the toys: a config for the cache, the cache protocol, a parameter for dtype/device."""

    def __init__(self, vocab_size: int, block_size: int) -> None:
        super().__init__()
        self.config = GPTConfig(vocab_size=vocab_size, block_size=block_size, n_layer=1, d_model=2, n_head=1)
        self.anchor = nn.Parameter(torch.zeros(()))

    def forward(self, idx, targets=None, attention_mask=None, position_ids=None, kv_cache=None):
        B, T = idx.shape
        past = kv_cache[0].length if kv_cache is not None else 0
        if kv_cache is not None:
            for layer in kv_cache:  # store something, as attention would, so the cache length advances
                layer.update(torch.zeros(B, 1, T, 2), torch.zeros(B, 1, T, 2))
        if position_ids is None:
            position_ids = torch.arange(past, past + T)[None].expand(B, T)
        return self.logits(idx, position_ids.expand(B, T)), None


class BigramLM(_ToyLM):
    """log p(next | last) = log_probs[last, next]: a Markov chain over the vocabulary."""

    def __init__(self, probs: torch.Tensor, block_size: int = 64) -> None:
        super().__init__(probs.size(0), block_size)
        self.table = probs.clamp_min(1e-12).log()  # (V, V)

    def logits(self, idx, position_ids):
        return self.table[idx]  # (B, T, V)


class ScriptedLM(_ToyLM):
    """At position p predicts script[p + 1] with probability ~1 (and the last token forever after)."""

    def __init__(self, script: list[int], vocab_size: int, block_size: int = 256) -> None:
        super().__init__(vocab_size, block_size)
        self.script = torch.tensor(script)

    def logits(self, idx, position_ids):
        nxt = self.script[(position_ids + 1).clamp(max=len(self.script) - 1)]  # (B, T)
        return torch.nn.functional.one_hot(nxt, self.config.vocab_size).float() * 50.0  # (B, T, V)
