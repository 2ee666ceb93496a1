"""The learning-rate schedule at steps worked out by hand."""

import math

import pytest

from tinylm.errors import TinyLMError
from tinylm.train.schedule import lr_at, momentum_at

# peak 1.0, floor 0.1, 10 warmup steps, 111 steps: the decay runs over steps 10..110 (100 intervals)
S = dict(lr=1.0, min_lr=0.1, warmup=10, total=111)


def test_linear_warmup_reaches_the_peak_at_the_last_warmup_step():
    assert lr_at(0, **S) == pytest.approx(0.1)  # 1/10 of the peak on the first step, never 0
    assert lr_at(4, **S) == pytest.approx(0.5)
    assert lr_at(9, **S) == pytest.approx(1.0)


def test_cosine_starts_at_the_peak_passes_the_midpoint_and_ends_on_the_floor():
    assert lr_at(10, **S) == pytest.approx(1.0)
    assert lr_at(60, **S) == pytest.approx(0.55)  # halfway: min + (max - min) / 2
    assert lr_at(35, **S) == pytest.approx(0.1 + 0.9 * (1 + math.cos(math.pi / 4)) / 2)  # a quarter of the way
    assert lr_at(110, **S) == pytest.approx(0.1)  # the last step is exactly min_lr
    assert lr_at(500, **S) == pytest.approx(0.1)  # past the end it stays there


def test_linear_decay_and_constant():
    assert lr_at(60, **S, decay="linear") == pytest.approx(0.55)
    assert lr_at(35, **S, decay="linear") == pytest.approx(1.0 - 0.9 * 0.25)
    assert lr_at(110, **S, decay="linear") == pytest.approx(0.1)
    assert lr_at(110, **S, decay="constant") == 1.0
    assert lr_at(3, **S, decay="constant") == pytest.approx(0.4)  # warmup applies to every decay


def test_no_warmup_and_a_single_step():
    assert lr_at(0, lr=2.0, min_lr=0.0, warmup=0, total=3) == pytest.approx(2.0)
    assert lr_at(1, lr=2.0, min_lr=0.0, warmup=0, total=3) == pytest.approx(1.0)
    assert lr_at(0, lr=2.0, min_lr=0.5, warmup=0, total=1) == pytest.approx(0.5)  # nothing to decay over


def test_unknown_decay():
    with pytest.raises(TinyLMError, match="unknown decay"):
        lr_at(0, **S, decay="exponential")


# warmup-stable-decay: peak 1.0, floor 0.1, 10 warmup steps, 100 steps, the last 20% (20 steps) decay
W = dict(lr=1.0, min_lr=0.1, warmup=10, total=100, decay="wsd", fraction=0.2)


def test_wsd_holds_the_peak_then_decays_linearly_over_the_last_fraction():
    assert lr_at(4, **W) == pytest.approx(0.5)  # the same warmup as every decay
    assert lr_at(10, **W) == 1.0 and lr_at(79, **W) == 1.0  # stable: steps 10..79
    # the decay starts at step 80 = 100 - 20 and spans 19 intervals to the last step, 99
    assert lr_at(80, **W) == 1.0
    assert lr_at(89, **W) == pytest.approx(1.0 - 0.9 * 9 / 19)
    assert lr_at(99, **W) == pytest.approx(0.1)
    assert lr_at(150, **W) == pytest.approx(0.1)


def test_wsd_one_minus_sqrt_drops_fastest_at_first():
    S1 = {**W, "shape": "1-sqrt", "min_lr": 0.0}
    assert lr_at(80, **S1) == 1.0
    q = 5 / 19  # step 85: 5 of the 19 intervals of the decay
    assert lr_at(85, **S1) == pytest.approx(1.0 - math.sqrt(q))
    assert lr_at(99, **S1) == pytest.approx(0.0)
    linear = {**W, "min_lr": 0.0}
    assert lr_at(85, **S1) < lr_at(85, **linear)  # 1 - sqrt(q) < 1 - q for q in (0, 1)


def test_wsd_decay_never_starts_inside_the_warmup():
    # 90% decay of 20 steps would start at step 2, inside a 5-step warmup: it starts after it instead
    short = dict(lr=1.0, min_lr=0.0, warmup=5, total=20, decay="wsd", fraction=0.9)
    assert lr_at(4, **short) == pytest.approx(1.0)
    assert lr_at(5, **short) == 1.0
    assert lr_at(19, **short) == pytest.approx(0.0)


def test_linear_decay_to_zero_ends_at_zero():
    assert lr_at(60, lr=1.0, min_lr=0.0, warmup=10, total=111, decay="linear") == pytest.approx(0.5)
    assert lr_at(110, lr=1.0, min_lr=0.0, warmup=10, total=111, decay="linear") == 0.0


def test_muon_momentum_warmup_rises_from_0_85():
    assert momentum_at(0, momentum=0.95, warmup=100) == pytest.approx(0.85)
    assert momentum_at(50, momentum=0.95, warmup=100) == pytest.approx(0.90)
    assert momentum_at(100, momentum=0.95, warmup=100) == 0.95
    assert momentum_at(7, momentum=0.95, warmup=0) == 0.95
