"""The learning-rate schedule at steps worked out by hand."""

import math

import pytest

from tinylm.errors import TinyLMError
from tinylm.train.schedule import lr_at

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
