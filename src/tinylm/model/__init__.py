"""The models: a GPT-style Transformer language model and its parts.

- `GPTConfig` (defined in `tinylm.config`, re-exported here): the shape and choices of a model.
- `GPT`: token ids -> next-token logits and loss (`tinylm.model.gpt`).
- attention in three interchangeable implementations, `reference_attention`, `sdpa_attention` and
  `tiled_attention`, behind `CausalSelfAttention` (`tinylm.model.attention`).
- position information: learned, sinusoidal, rotary, or none (`tinylm.model.positions`).
"""

from tinylm.config import GPTConfig
from tinylm.model.attention import (
    CausalSelfAttention,
    KVCacheLayer,
    reference_attention,
    repeat_kv,
    sdpa_attention,
    tiled_attention,
)
from tinylm.model.gpt import GPT, IGNORE_INDEX, MLP, Block, RMSNorm
from tinylm.model.positions import LearnedPositions, RotaryPositions, SinusoidalPositions, apply_rope

__all__ = [
    "GPT", "GPTConfig", "IGNORE_INDEX", "Block", "MLP", "RMSNorm",
    "CausalSelfAttention", "KVCacheLayer", "reference_attention", "sdpa_attention", "tiled_attention", "repeat_kv",
    "LearnedPositions", "SinusoidalPositions", "RotaryPositions", "apply_rope",
]
