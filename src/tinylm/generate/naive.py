"""The naive sampler: ancestral sampling by recomputing the whole context at every step.

To generate, repeat: run the model on the tokens so far, take the logits u_t of the last
position, turn them into the next-token distribution softmax(u_t / temperature) (keeping only
the k most likely tokens if ``top_k`` is set), draw a token from it, append it. Stop after
``max_new_tokens`` or when the model draws EOS (that is how a model that has learned to end a
document ends its text).

This is the reference, written to be obviously right rather than fast: each step costs a full
forward pass over the context, so n new tokens cost O(n) passes of growing length. A KV-cache
engine gives the same tokens for a fraction of the work; this function is what it is tested
against.

When the context is longer than the model's ``block_size`` only the last ``block_size`` tokens
are fed (a sliding window): the model cannot see further back than it was trained to.

Temperature 0 means greedy decoding (always the most likely token). A seed makes the draw
reproducible: the same model, prompt and seed give the same tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from tinylm.errors import TinyLMError


def next_token_distribution(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None) -> torch.Tensor:
    """Probabilities (|V|,) from the last position's logits (|V|,): temperature, then top-k, then softmax."""
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k).values[-1]  # the k-th largest logit
        logits = logits.masked_fill(logits < kth, float("-inf"))  # ties with the k-th are kept
    return torch.softmax(logits, dim=-1)


@torch.no_grad()
def generate_naive(
    model: nn.Module,
    prompt: Sequence[int],
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    seed: int | None = None,
    eos_id: int | None = None,
) -> list[int]:
    """The new token ids (EOS not included) sampled after ``prompt`` (see the module docstring).

    ``model(idx)`` returns logits (B, T, |V|) or a tuple starting with them, and has
    ``config.block_size``. ``top_k`` None or 0 samples from the whole vocabulary.
    """
    if len(prompt) == 0:
        raise TinyLMError("the prompt must hold at least one token (e.g. the BOS or EOS id)")
    if temperature < 0:
        raise TinyLMError(f"temperature must be 0 or more, got {temperature}")
    if max_new_tokens < 0:
        raise TinyLMError(f"max_new_tokens must be 0 or more, got {max_new_tokens}")
    device = next(model.parameters()).device
    block_size = model.config.block_size
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()  # a fresh, non-deterministic seed for this generator only
    else:
        generator.manual_seed(seed)
    was_training = model.training
    model.eval()
    tokens = [int(t) for t in prompt]
    new: list[int] = []
    try:
        for _ in range(max_new_tokens):
            idx = torch.tensor([tokens[-block_size:]], dtype=torch.long, device=device)  # (1, T)
            out = model(idx)
            logits = (out[0] if isinstance(out, tuple) else out)[0, -1]  # (|V|,) the last position's u_t
            if temperature == 0:
                token = int(logits.argmax())
            else:
                probs = next_token_distribution(logits, temperature, top_k or None)
                token = int(torch.multinomial(probs, 1, generator=generator))
            if token == eos_id:
                break
            tokens.append(token)
            new.append(token)
    finally:
        model.train(was_training)
    return new
