"""Looking inside one step: the next-token distribution and the attention weights behind it.

`next_token_candidates` answers "what does the model think comes next?": the most likely tokens
with their probabilities at a temperature, over the tokens a sample may take (never padding,
BOS, reserved ids or ``<unk>``: `drawable_logits`), so they are the probabilities samples are
drawn with. Dividing the logits by tau before the softmax
reshapes the distribution without reordering it: logits (2, 1, -1) give probabilities
(0.705, 0.259, 0.035) at tau = 1, (0.879, 0.119, 0.002) at tau = 0.5 and (0.547, 0.331, 0.122)
at tau = 2. `temperature_table` lays several temperatures side by side, which is what
`tinylm next-token --temperatures 0.5,1,2` prints.

`attention_maps` gives every layer's attention weights for a text (row i of a head's map is how
position i spreads its attention over positions 0..i), for heatmaps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from tinylm.config import FAMILY_NAMES
from tinylm.errors import TinyLMError
from tinylm.generate.sampling import SamplingParams, excluded_mask, sampling_distribution
from tinylm.generate.steps import keep_prompt
from tinylm.tokenizers.base import Tokenizer


@dataclass
class Candidate:
    """A possible next token: its id, its bytes, its logit and its probability at the chosen temperature."""

    token_id: int
    token_bytes: bytes
    logit: float
    probability: float

    @property
    def text(self) -> str:
        """The token's text (U+FFFD for bytes that are only part of a character)."""
        return self.token_bytes.decode("utf-8", errors="replace")

    def display(self) -> str:
        """For a table: the text in quotes, or the bytes (b'\\xe4') when they are not whole characters."""
        try:
            return repr(self.token_bytes.decode("utf-8"))
        except UnicodeDecodeError:
            return repr(self.token_bytes)


def temperature_probabilities(logits: Tensor, temperature: float) -> Tensor:
    """softmax(logits / temperature) over the last axis; temperature 0 puts all mass on the argmax."""
    probs = sampling_distribution(logits.reshape(-1, logits.size(-1)), SamplingParams(temperature=temperature))
    return probs.reshape(logits.shape)


@torch.inference_mode()
def next_token_logits(model: nn.Module, ids: Sequence[int]) -> Tensor:
    """The model's logits (V,) for the token after ``ids`` (only the last block_size tokens are read, with the
    warning of `tinylm.generate.steps.keep_prompt` when that drops some)."""
    logits, _ = _in_eval_mode(model, model, ids)  # (1, T, V)
    return logits[0, -1].float()  # (V,)


def _in_eval_mode(model: nn.Module, fn, ids: Sequence[int]):
    """``fn`` of the last block_size tokens of ``ids`` as a (1, T) batch, with ``model`` in eval mode meanwhile."""
    window = keep_prompt(ids, model.config.block_size)
    idx = torch.tensor([window], dtype=torch.long, device=next(model.parameters()).device)  # (1, T)
    was_training = model.training
    model.eval()
    try:
        return fn(idx)
    finally:
        model.train(was_training)


def drawable_logits(model: nn.Module, tokenizer: Tokenizer, ids: Sequence[int]) -> Tensor:
    """The next-token logits (V,) over the tokenizer's ids as sampling sees them: -inf at the ids no sampler
    draws (padding, BOS, reserved ids, <unk>; `tinylm.generate.sampling.excluded_mask`), so the
    probabilities shown are the ones samples are drawn with."""
    logits = next_token_logits(model, ids)[: tokenizer.vocab_size].clone()  # (V,) ids the tokenizer can show
    excluded = excluded_mask(tokenizer, tokenizer.vocab_size, device=logits.device)
    if excluded is not None:
        logits.masked_fill_(excluded, float("-inf"))
    return logits


def left_out(model: nn.Module, tokenizer: Tokenizer, ids: Sequence[int]) -> list[tuple[int, float]]:
    """The ids no sample takes with the probability the model gives each (at temperature 1), largest first: the
    mass `drawable_logits` removes before the rest is rescaled."""
    logits = next_token_logits(model, ids)[: tokenizer.vocab_size]
    excluded = excluded_mask(tokenizer, tokenizer.vocab_size, device=logits.device)
    if excluded is None:
        return []
    probs = torch.softmax(logits, dim=-1)
    return sorted(((int(i), float(probs[i])) for i in torch.nonzero(excluded)[:, 0]), key=lambda x: -x[1])


def next_token_candidates(model: nn.Module, tokenizer: Tokenizer, ids: Sequence[int], top: int = 10,
                          temperature: float = 1.0) -> list[Candidate]:
    """The ``top`` most likely next tokens after ``ids``, most likely first, with probabilities at ``temperature``."""
    return _candidates(drawable_logits(model, tokenizer, ids), tokenizer, top, temperature)


def top_ids(logits: Tensor, top: int) -> list[int]:
    """The ``top`` ids of the highest logits, highest first (ties by id), leaving out the ids never drawn (-inf)."""
    order = torch.argsort(logits, descending=True, stable=True)[:top]  # temperature never changes the order
    return [int(i) for i in order if logits[i] > float("-inf")]


def _candidates(logits: Tensor, tokenizer: Tokenizer, top: int, temperature: float) -> list[Candidate]:
    probs = temperature_probabilities(logits, temperature)  # (V,)
    return [Candidate(i, tokenizer.token_bytes(i), float(logits[i]), float(probs[i])) for i in top_ids(logits, top)]


def temperature_table(model: nn.Module, tokenizer: Tokenizer, ids: Sequence[int], temperatures: Sequence[float],
                      top: int = 10) -> tuple[list[Candidate], list[list[float]]]:
    """The ``top`` candidates (at temperature 1) and, for each, its probability at each of ``temperatures``."""
    logits = drawable_logits(model, tokenizer, ids)  # one forward pass for every column
    candidates = _candidates(logits, tokenizer, top, 1.0)
    columns = [temperature_probabilities(logits, t) for t in temperatures]  # each (V,)
    return candidates, [[float(col[c.token_id]) for col in columns] for c in candidates]


def format_candidates(candidates: Sequence[Candidate], temperatures: Sequence[float] | None = None,
                      table: Sequence[Sequence[float]] | None = None, temperature: float = 1.0) -> str:
    """A plain-text table: rank, id, the token (see `Candidate.display`) and its probability at each temperature."""
    temps = list(temperatures) if temperatures is not None else [temperature]
    header = f"{'rank':>4}  {'id':>6}  {'token':<16}" + "".join(f"  {'T=' + format(t, 'g'):>8}" for t in temps)
    lines = [header]
    for rank, c in enumerate(candidates, 1):
        probs = table[rank - 1] if table is not None else [c.probability]
        lines.append(f"{rank:>4}  {c.token_id:>6}  {c.display():<16}" + "".join(f"  {p:>8.4f}" for p in probs))
    return "\n".join(lines)


def attention_maps(model: nn.Module, ids: Sequence[int]) -> list[Tensor]:
    """Each layer's attention weights (n_head, T, T) for the sequence ``ids`` (its last block_size tokens)."""
    if not hasattr(model, "attention_weights"):
        family = getattr(getattr(model, "config", None), "family", None)
        what = f"{FAMILY_NAMES[family]} model" if family in FAMILY_NAMES else type(model).__name__
        raise TinyLMError(f"{what} has no attention to show; attention maps are the Transformer's")
    weights = _in_eval_mode(model, model.attention_weights, ids)  # per layer (1, nh, T, T)
    return [w[0] for w in weights]
