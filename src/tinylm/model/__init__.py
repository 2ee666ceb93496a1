"""The models: a GPT-style Transformer language model and its parts, and the baselines before it.

- `GPTConfig` (defined in `tinylm.config`, re-exported here): the shape and choices of a model;
  its ``family`` says which kind ("gpt", "lstm", "rnn", "ngram"), and `build_model` builds it.
- `GPT`: token ids -> next-token logits and loss (`tinylm.model.gpt`).
- `RecurrentLM`: the RNN and LSTM language models, with the same forward (`tinylm.model.rnn`).
- `NGramModel`: counted n-gram models (`tinylm.model.ngram`); `NGramLM` puts one behind the same
  forward for generation (`tinylm.model.ngram_lm`).
- attention in three interchangeable implementations, `reference_attention`, `sdpa_attention` and
  `tiled_attention`, behind `CausalSelfAttention` (`tinylm.model.attention`).
- position information: learned, sinusoidal, rotary, or none (`tinylm.model.positions`).
"""

from tinylm.config import FAMILY_NAMES, GPTConfig
from tinylm.errors import TinyLMError
from tinylm.model.attention import (
    CausalSelfAttention,
    KVCacheLayer,
    reference_attention,
    repeat_kv,
    sdpa_attention,
    tiled_attention,
)
from tinylm.model.gpt import GPT, IGNORE_INDEX, MLP, Block, RMSNorm
from tinylm.model.ngram import NGramModel
from tinylm.model.ngram_lm import NGramLM
from tinylm.model.positions import LearnedPositions, RotaryPositions, SinusoidalPositions, apply_rope
from tinylm.model.rnn import RecurrentLM, RecurrentState


def build_model(config: GPTConfig):
    """A freshly initialised network of ``config.family``: `GPT` or `RecurrentLM`.

    n-gram models are counted from data, not initialised: see `NGramModel.fit`.
    """
    if config.family == "gpt":
        return GPT(config)
    if config.family in ("rnn", "lstm"):
        return RecurrentLM(config)
    raise TinyLMError(f"{FAMILY_NAMES[config.family]} model is counted from data, not built with weights; "
                      "use NGramModel.fit (or `tinylm train --model ngram`)")


__all__ = [
    "build_model", "RecurrentLM", "RecurrentState", "NGramModel", "NGramLM",
    "GPT", "GPTConfig", "IGNORE_INDEX", "Block", "MLP", "RMSNorm",
    "CausalSelfAttention", "KVCacheLayer", "reference_attention", "sdpa_attention", "tiled_attention", "repeat_kv",
    "LearnedPositions", "SinusoidalPositions", "RotaryPositions", "apply_rope",
]
