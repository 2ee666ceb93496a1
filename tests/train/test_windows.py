"""The sequence-length schedule: short windows for most steps, the model's block_size for the last ones."""

from __future__ import annotations

import re

import pytest
from diskkit import refused
from trainkit import cli_flags, tiny_config

from tinylm.config import TrainConfig
from tinylm.errors import TinyLMError
from tinylm.train import train
from tinylm.train.schedule import long_start, window_at

QUIET = dict(progress=False, log=lambda line: None)
# block_size 32 (trainkit's), windows of 8 for all but the last quarter of 8 steps: steps 0-5 short, 6-7 long
SCHEDULE = dict(short_block_size=8, long_fraction=0.25)


def test_the_last_long_fraction_of_the_steps_train_at_block_size():
    tc = TrainConfig(**SCHEDULE)
    assert long_start(tc, 8) == 6
    assert [window_at(tc, 32, 8, step) for step in range(8)] == [8, 8, 8, 8, 8, 8, 32, 32]
    assert long_start(TrainConfig(short_block_size=8, long_fraction=0.3), 10) == 7  # round(3.0): 3 long steps
    assert {window_at(TrainConfig(short_block_size=8, long_fraction=0.0), 32, 8, s) for s in range(8)} == {8}
    assert {window_at(TrainConfig(short_block_size=8, long_fraction=1.0), 32, 8, s) for s in range(8)} == {32}
    assert {window_at(TrainConfig(), 32, 8, s) for s in range(8)} == {32}  # no schedule
    # document and chat rows are one document or conversation each: always block_size
    assert {window_at(TrainConfig(batch_mode="documents", **SCHEDULE), 32, 8, s) for s in range(8)} == {32}


def test_extending_a_run_past_its_switch_says_which_steps_trained_on_long_windows(tmp_path, corpus, data_dir):
    train(tiny_config(corpus, data_dir, **SCHEDULE), tmp_path / "run", stop_after=7, **QUIET)  # steps 6 and 7 long
    lines = []
    train(tiny_config(corpus, data_dir, max_steps=12, **SCHEDULE), tmp_path / "run", resume=True, progress=False,
          log=lines.append)  # 12 steps: long from step 9
    assert any("the steps done from step 6 on trained on windows of 32 where a 12-step run trains on 8" in line
               for line in lines), lines


@pytest.mark.parametrize("settings, message", [
    (dict(short_block_size=12), "short_block_size 12 must divide block_size 32"),
    (dict(short_block_size=64), "short_block_size 64 is longer than block_size 32"),
    (dict(short_block_size=-8), "short_block_size must be 0 (no schedule)"),
    (dict(short_block_size=8, long_fraction=1.5), "long_fraction is a share of the steps in [0, 1], got 1.5"),
])
def test_a_schedule_that_does_not_fit_is_refused_in_one_line(tmp_path, capsys, corpus, data_dir, settings, message):
    with pytest.raises(TinyLMError, match=re.escape(message)):
        tiny_config(corpus, data_dir, **settings)
    flags = [f"--{key.replace('_', '-')}={value}" for key, value in settings.items()]
    refused(capsys, ["train", "--out", str(tmp_path / "x"), *cli_flags(corpus, data_dir), *flags], message)
