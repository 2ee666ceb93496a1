"""Position encodings: RoPE's relative-position property and layout, and the sinusoidal table's known values."""

from __future__ import annotations

import math

import torch

from tinylm.model.positions import (
    RopeScaling,
    RotaryPositions,
    SinusoidalPositions,
    apply_rope,
    rope_inverse_frequencies,
)


def rotated(x: torch.Tensor, position: int, rope: RotaryPositions) -> torch.Tensor:
    cos, sin = rope(torch.tensor([position]))  # (1, 1, 1, hs)
    return apply_rope(x.view(1, 1, 1, -1), cos, sin).flatten()


def test_rope_scores_depend_only_on_relative_position():
    rope = RotaryPositions(head_dim=16)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(16, generator=g, dtype=torch.float64), torch.randn(16, generator=g, dtype=torch.float64)
    for m, n in [(0, 0), (5, 2), (3, 9), (100, 37)]:
        base = rotated(q, m, rope) @ rotated(k, n, rope)
        for s in (1, 7, 250):
            torch.testing.assert_close(rotated(q, m + s, rope) @ rotated(k, n + s, rope), base, atol=1e-4, rtol=0)
    # and it does depend on the offset m - n
    assert not torch.isclose(rotated(q, 5, rope) @ rotated(k, 2, rope), rotated(q, 6, rope) @ rotated(k, 2, rope))


def test_rope_is_a_rotation_of_coordinate_pairs_i_and_i_plus_half():
    # the rotate-half (GPT-NeoX / Hugging Face Llama) layout, checked against complex multiplication:
    # z_i = x_i + i x_{i + hs/2} turns by e^{i m theta^(-2i/hs)}
    hs, m, theta = 8, 3, 10000.0
    x = torch.randn(hs, dtype=torch.float64)
    z = torch.complex(x[: hs // 2], x[hs // 2 :])
    angles = m * theta ** (-torch.arange(0, hs, 2, dtype=torch.float64) / hs)
    turned = z * torch.polar(torch.ones_like(angles), angles)
    expected = torch.cat([turned.real, turned.imag])
    torch.testing.assert_close(rotated(x, m, RotaryPositions(hs, theta)).double(), expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(rotated(x, m, RotaryPositions(hs, theta)).norm().double(), x.norm(), atol=1e-6, rtol=0)


def test_sinusoidal_table_matches_the_paper():
    d = 8
    pe = SinusoidalPositions(d)(torch.arange(50))  # (50, d)
    for pos in (0, 1, 17, 49):
        for i in range(d // 2):
            angle = pos / 10000 ** (2 * i / d)
            assert math.isclose(pe[pos, 2 * i].item(), math.sin(angle), abs_tol=1e-5)
            assert math.isclose(pe[pos, 2 * i + 1].item(), math.cos(angle), abs_tol=1e-5)


def test_llama3_rope_scaling_worked_by_hand():
    # head size 8, theta 10^4: frequencies 1, 0.1, 0.01, 0.001, wavelengths 2 pi / omega = 6.3, 63, 628, 6283.
    # With an original context of 1000, low_freq_factor 1 and high_freq_factor 4 the bounds are 1000 / 4 = 250
    # and 1000 / 1 = 1000: the first two pairs keep their frequency, the last is divided by the factor 8,
    # and the third blends with a = (1000 / 628.3 - 1) / (4 - 1) = 0.197.
    scaling = RopeScaling("llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_context=1000)
    a = (1000 / (2 * math.pi / 0.01) - 1) / 3
    expected = [1.0, 0.1, (1 - a) * 0.01 / 8 + a * 0.01, 0.001 / 8]
    got = rope_inverse_frequencies(8, 10000.0, scaling)
    torch.testing.assert_close(got, torch.tensor(expected), atol=0, rtol=1e-6)
    assert math.isclose(a, 0.19718, abs_tol=1e-5)


def test_linear_rope_scaling_turns_position_t_as_far_as_plain_rope_turns_t_over_the_factor():
    x = torch.randn(8, generator=torch.Generator().manual_seed(0))
    linear = RotaryPositions(8, 500.0, RopeScaling("linear", factor=4.0))
    torch.testing.assert_close(rotated(x, 12, linear), rotated(x, 3, RotaryPositions(8, 500.0)), atol=1e-6, rtol=0)


def test_a_models_rope_reads_its_scaling_from_the_configuration():
    from tinylm.config import GPTConfig
    from tinylm.model import GPT

    config = GPTConfig(vocab_size=16, block_size=8, n_layer=1, d_model=16, n_head=2, positions="rope",
                       rope_scaling="linear", rope_factor=2.0)
    assert GPT(config).rope.scaling == RopeScaling("linear", 2.0)
