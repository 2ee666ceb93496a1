"""The learning-rate schedule: linear warmup, then cosine or linear decay to a floor.

Steps are counted from 0; ``lr_at(step, ...)`` is the rate used by the optimizer step with that
index. With peak ``lr``, floor ``min_lr``, ``warmup`` steps and ``total`` steps in all:

    warmup   step < warmup:   lr * (step + 1) / warmup          (reaches lr at step warmup - 1)
    decay    step >= warmup:  p = (step - warmup) / (total - 1 - warmup), in [0, 1]
             cosine:  min_lr + (lr - min_lr) * (1 + cos(pi p)) / 2
             linear:  lr - (lr - min_lr) * p
             constant: lr

so the decay starts at the peak on the first step after warmup and lands exactly on min_lr at
the last step, total - 1. Why warm up: Adam's second-moment estimate is poor for the first
steps, so full-size updates then can throw a fresh model far off; a few hundred steps of
growing rates let the estimates settle. Why decay: near the end, smaller steps average out the
noise of the mini-batch gradient and settle into a lower loss.
"""

from __future__ import annotations

import math

from tinylm.errors import TinyLMError

DECAYS = ("cosine", "linear", "constant")


def lr_at(step: int, *, lr: float, min_lr: float, warmup: int, total: int, decay: str = "cosine") -> float:
    """The learning rate for optimizer step ``step`` (0-based) of ``total`` (see the module docstring)."""
    if decay not in DECAYS:
        raise TinyLMError(f"unknown decay {decay!r}; expected one of {', '.join(DECAYS)}")
    if step < warmup:
        return lr * (step + 1) / warmup
    if decay == "constant":
        return lr
    span = total - 1 - warmup
    progress = 1.0 if span <= 0 else min(max((step - warmup) / span, 0.0), 1.0)
    if decay == "linear":
        return lr - (lr - min_lr) * progress
    return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
