"""Position information: attention alone cannot tell the order of its inputs.

``GPTConfig.positions`` picks how order goes in: "learned" (GPT-2's table added to the
embeddings), "sinusoidal" (the fixed table of "Attention Is All You Need"), "rope" (queries and
keys rotated by position, in the "rotate half" layout of GPT-NeoX and Hugging Face's Llama, with
optional "linear" or "llama3" scaling of the frequencies) or "none". Everything takes
``position_ids`` ((T,) or (B, T)) rather than assuming 0..T-1, so left-padded rows and cached
steps get their true positions. docs/model.md has the formulas and the RoPE scaling rule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from tinylm.config import GPTConfig


class LearnedPositions(nn.Module):
    """A trained table P, one d-vector per position, added to the token embeddings."""

    def __init__(self, block_size: int, d_model: int) -> None:
        super().__init__()
        self.P = nn.Embedding(block_size, d_model)

    def forward(self, position_ids: Tensor) -> Tensor:
        return self.P(position_ids)  # (B or 1, T, d)


class SinusoidalPositions(nn.Module):
    """The fixed sin/cos table of Vaswani et al. (2017), added to the token embeddings; no parameters."""

    def __init__(self, d_model: int, base: float = 10000.0) -> None:
        super().__init__()
        self.d_model = d_model
        self.base = base

    def forward(self, position_ids: Tensor) -> Tensor:
        # frequency i is 1 / base^(2i/d) for i = 0..d/2-1: from one turn per 2*pi positions down to
        # one turn per 2*pi*base positions, so nearby and far-apart positions both stay distinguishable
        inv_freq = _inverse_frequencies(self.d_model, self.base, position_ids.device)  # (d/2,)
        angles = position_ids[..., None].float() * inv_freq  # (B or 1, T, d/2)
        # interleave: column 2i is the sine and column 2i+1 the cosine of frequency i
        return torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(-2)  # (B or 1, T, d)


@dataclass(frozen=True)
class RopeScaling:
    """How RoPE's frequencies are stretched (module docstring): "linear" reads ``factor`` only."""

    kind: str  # "linear" or "llama3"
    factor: float
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_context: int | None = None

    @classmethod
    def of(cls, config: GPTConfig) -> RopeScaling | None:
        """The scaling a configuration asks for, or None for plain RoPE."""
        if config.rope_scaling == "none":
            return None
        return cls(config.rope_scaling, config.rope_factor, config.rope_low_freq_factor,
                   config.rope_high_freq_factor, config.rope_original_context)


def rope_inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None,
                             device: torch.device | str = "cpu") -> Tensor:
    """omega_i = theta^(-2i/d_h) for i = 0..d_h/2-1, then scaled as ``scaling`` says: (d_h/2,) float32."""
    inv_freq = _inverse_frequencies(head_dim, theta, device)  # (hs/2,)
    if scaling is None:
        return inv_freq
    s = scaling.factor
    if scaling.kind == "linear":
        return inv_freq / s
    L, low, high = scaling.original_context, scaling.low_freq_factor, scaling.high_freq_factor
    wavelength = 2 * math.pi / inv_freq  # (hs/2,) positions per turn
    a = ((L / wavelength - low) / (high - low)).clamp(0.0, 1.0)  # 1: keep omega (short waves), 0: omega / s
    return (1 - a) * inv_freq / s + a * inv_freq  # (hs/2,)


class RotaryPositions(nn.Module):
    """Rotary position embeddings (Su et al., 2021): the cos and sin that `apply_rope` rotates q and k by."""

    def __init__(self, head_dim: int, theta: float = 10000.0, scaling: RopeScaling | None = None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        self.scaling = scaling

    def forward(self, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        inv_freq = rope_inverse_frequencies(self.head_dim, self.theta, self.scaling, position_ids.device)  # (hs/2,)
        angles = position_ids[..., None].float() * inv_freq  # (B or 1, T, hs/2)
        # rotate-half layout: coordinate i and coordinate i + hs/2 form pair i, so both halves of the
        # head see the same angles
        angles = torch.cat((angles, angles), dim=-1)  # (B or 1, T, hs)
        # a head axis to broadcast over: q and k are (B, nh, T, hs)
        return angles.cos()[:, None], angles.sin()[:, None]  # 2 x (B or 1, 1, T, hs)


def rotate_half(x: Tensor) -> Tensor:
    """(x1, x2) -> (-x2, x1) on the two halves of the last axis: a quarter turn of every pair (x1_i, x2_i)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate every pair (x_i, x_{i+hs/2}) of ``x`` (B, nh, T, hs) by its position's angle.

    The 2-D rotation [[cos, -sin], [sin, cos]] applied to (a, b) is (a cos - b sin, b cos + a sin),
    which is x * cos + rotate_half(x) * sin written for all pairs at once.
    """
    # in x's dtype (as Hugging Face's Llama does): under bfloat16 autocast, rotating in float32 cost
    # a copy of q and k each way; float32 models are unchanged
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return x * cos + rotate_half(x) * sin  # (B, nh, T, hs)


def _inverse_frequencies(dim: int, base: float, device: torch.device) -> Tensor:
    return base ** (-torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim)  # (dim/2,)
