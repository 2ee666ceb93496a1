"""The learning-rate schedule: linear warmup, then a decay to a floor (cosine, linear, or warmup-stable-decay).

Steps are counted from 0; ``lr_at(step, ...)`` is the rate used by the optimizer step with that
index. With peak ``lr``, floor ``min_lr``, ``warmup`` steps and ``total`` steps in all:

    warmup   step < warmup:   lr * (step + 1) / warmup          (reaches lr at step warmup - 1)
    decay    step >= warmup:  p = (step - warmup) / (total - 1 - warmup), in [0, 1]
             cosine:  min_lr + (lr - min_lr) * (1 + cos(pi p)) / 2
             linear:  lr - (lr - min_lr) * p                     (with min_lr = 0: linear decay to zero)
             constant: lr
    wsd      warmup, then lr held ("stable") until the last ``fraction`` of all steps, over which
             q = (step - start) / (total - 1 - start) runs from 0 to 1 (start = total - round(fraction * total),
             never inside the warmup) and the rate falls to min_lr:
             linear:  lr - (lr - min_lr) * q
             1-sqrt:  min_lr + (lr - min_lr) * (1 - sqrt(q))

so every decay starts at the peak and lands exactly on min_lr at the last step, total - 1. Why
warm up: Adam's second-moment estimate is poor for the first steps, so full-size updates then can
throw a fresh model far off; a few steps of growing rates let the estimates settle. Why decay:
near the end, smaller steps average out the noise of the mini-batch gradient and settle into a
lower loss. Why warmup-stable-decay (Hu et al., 2024, "MiniCPM"; Hägele et al., 2024): a high
rate for longer makes faster progress, and a short final decay collects it; the stable phase does
not depend on the run's length, so a run can be extended before its decay starts.

`window_at` is the sequence-length schedule: with ``short_block_size`` (packed batches), the steps
train on short windows, as many more rows of them as keep a step's tokens, until the last
``long_fraction`` of the steps (from ``total - round(long_fraction * total)`` on), which train on
windows of the model's block_size. Short windows are cheaper per token in attention and give the
same gradient noise per step; the long steps at the end teach the model the far positions (RoPE
has no position table to learn, so a model trained at 128 is already a model of 512 positions).

`group_lr` is the schedule a run's [train] settings give one optimizer group. `momentum_at` is
Muon's momentum warm-up (modded-nanogpt's): from 0.85 up to its value over the
first ``warmup`` steps, which damps the first, noisiest updates.
"""

from __future__ import annotations

import math

from tinylm.config import TrainConfig
from tinylm.errors import TinyLMError

DECAYS = ("cosine", "linear", "constant", "wsd")
WSD_SHAPES = ("linear", "1-sqrt")
MOMENTUM_START = 0.85


def lr_at(step: int, *, lr: float, min_lr: float, warmup: int, total: int, decay: str = "cosine",
          fraction: float = 0.2, shape: str = "linear") -> float:
    """The learning rate for optimizer step ``step`` (0-based) of ``total`` (see the module docstring)."""
    if decay not in DECAYS:
        raise TinyLMError(f"unknown decay {decay!r}; expected one of {', '.join(DECAYS)}")
    if step < warmup:
        return lr * (step + 1) / warmup
    if decay == "constant":
        return lr
    if decay == "wsd":
        if shape not in WSD_SHAPES:
            raise TinyLMError(f"unknown decay shape {shape!r}; expected one of {', '.join(WSD_SHAPES)}")
        start = max(total - round(fraction * total), warmup)
        span = total - 1 - start
        if step < start:
            return lr
        q = 1.0 if span <= 0 else min((step - start) / span, 1.0)
        if shape == "1-sqrt":
            return min_lr + (lr - min_lr) * (1.0 - math.sqrt(q))
        return lr - (lr - min_lr) * q
    span = total - 1 - warmup
    progress = 1.0 if span <= 0 else min(max((step - warmup) / span, 0.0), 1.0)
    if decay == "linear":
        return lr - (lr - min_lr) * progress
    return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def momentum_at(step: int, *, momentum: float, warmup: int) -> float:
    """Muon's momentum at ``step``: MOMENTUM_START rising linearly to ``momentum`` over ``warmup`` steps, then held."""
    if warmup <= 0 or step >= warmup or momentum <= MOMENTUM_START:
        return momentum
    return MOMENTUM_START + (momentum - MOMENTUM_START) * step / warmup


def group_lr(tc: TrainConfig, total: int, step: int, peak: float) -> float:
    """The schedule of ``tc`` over ``total`` steps at ``step``, for a group whose peak rate is ``peak``
    (its floor: the same share of it)."""
    floor = tc.final_lr if peak == tc.lr else tc.final_lr * peak / tc.lr
    return lr_at(step, lr=peak, min_lr=floor, warmup=tc.warmup_steps, total=total,
                 decay=tc.decay, fraction=tc.decay_fraction, shape=tc.decay_shape)


def long_start(tc: TrainConfig, total: int) -> int:
    """The first step of ``total`` that trains on windows of the model's block_size (0: every step does)."""
    if not tc.short_block_size or tc.batch_mode != "packed":
        return 0
    return total - round(tc.long_fraction * total)


def window_at(tc: TrainConfig, block_size: int, total: int, step: int) -> int:
    """The window length (tokens a row) of step ``step`` of ``total``: short_block_size before `long_start`,
    ``block_size`` from it on (see the module docstring)."""
    return block_size if step >= long_start(tc, total) else tc.short_block_size
