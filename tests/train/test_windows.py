"""The sequence-length schedule: short windows for most steps, the model's block_size for the last ones."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from diskkit import refused
from trainkit import cli_flags, tiny_config

from tinylm.config import TrainConfig, resolve_config
from tinylm.data.shards import ShardSet
from tinylm.errors import TinyLMError
from tinylm.run import checkpoint_path, load_checkpoint, read_metrics
from tinylm.train import train
from tinylm.train.batches import BatchSource, micro_batches
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


def test_a_short_step_holds_as_many_more_rows_as_keep_its_tokens(data_dir):
    shards = ShardSet.open(data_dir)
    tok = shards.tokenizer()
    src = BatchSource(shards, mode="packed", batch_size=4, block_size=32, seed=7, bos_id=tok.bos_id, pad_id=tok.pad_id)
    short, long = src.step_batch(5, grad_accum=2, window=8), src.step_batch(5, grad_accum=2)
    assert short.x.shape == (32, 8) and long.x.shape == (8, 32)
    assert short.x.size == long.x.size == short.n_targets == 2 * 4 * 32
    # still a pure function of (seed, step): the step's generator, 32 windows of 8 (+1 for the targets)
    x, y = shards.sample_windows("train", 32, 8, np.random.default_rng([7, 5]))
    np.testing.assert_array_equal(short.x, x)
    np.testing.assert_array_equal(short.y, y)
    # micro-batches of 4 * 4 rows, cut among 2 processes as a long step's are
    parts = [micro_batches(short, 16, rank, 2) for rank in (0, 1)]
    assert [len(p) for p in parts] == [2, 2] and all(mb.x.shape == (8, 8) for p in parts for mb in p)
    np.testing.assert_array_equal(np.concatenate([parts[r][i].x for i in (0, 1) for r in (0, 1)]), short.x)


def test_a_run_trains_each_step_on_its_windows_with_the_same_tokens(tmp_path, corpus, data_dir, monkeypatch):
    shapes = []
    step_batch = BatchSource.step_batch

    def recorded(self, step, grad_accum=1, window=None):
        batch = step_batch(self, step, grad_accum, window)
        shapes.append(batch.x.shape)
        return batch

    monkeypatch.setattr(BatchSource, "step_batch", recorded)
    lines = []
    result = train(tiny_config(corpus, data_dir, **SCHEDULE), tmp_path / "run", progress=False, log=lines.append)
    assert result.status == "complete" and result.tokens == 8 * 4 * 32
    assert shapes == [(16, 8)] * 6 + [(4, 32)] * 2
    tokens = [r["tokens"] for r in read_metrics(tmp_path / "run") if r["kind"] == "train"]
    assert tokens == [4 * 32 * step for step in range(1, 9)]
    assert "windows: steps 1-6 on 16 x 8 tokens, the last 2 (25%) on 4 x 32: the same tokens a step" in lines


def test_a_run_stopped_before_the_switch_resumes_bitwise(tmp_path, corpus, data_dir):
    cfg = tiny_config(corpus, data_dir, dropout=0.1, grad_accum=2, checkpoint_interval=3, **SCHEDULE)
    straight = train(cfg, tmp_path / "straight", **QUIET)
    train(cfg, tmp_path / "halves", stop_after=5, **QUIET)  # steps 0-4 short; 5 short and 6-7 long after the resume
    second = train(None, tmp_path / "halves", resume=True, **QUIET)
    assert load_checkpoint(checkpoint_path(tmp_path / "halves")).config.train.short_block_size == 8
    a, b = load_checkpoint(straight.checkpoint).model_state(), load_checkpoint(second.checkpoint).model_state()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    losses = [{r["step"]: r["loss"] for r in read_metrics(run) if r["kind"] == "train"}
              for run in (tmp_path / "straight", tmp_path / "halves")]
    assert losses[0] == losses[1]


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


def test_the_presets_schedule_gives_way_to_a_block_size_it_does_not_fit():
    tiny = resolve_config()
    assert tiny.train.short_block_size and tiny.model.block_size % tiny.train.short_block_size == 0
    assert resolve_config(overrides={"block_size": 64}).train.short_block_size == 0  # every step at 64
    assert resolve_config(overrides={"block_size": 1024}).train.short_block_size == tiny.train.short_block_size
    with pytest.raises(TinyLMError, match="short_block_size 128 is longer than block_size 64"):
        resolve_config(overrides={"block_size": 64, "short_block_size": 128})  # asked for: refused, not dropped
    documents = resolve_config(overrides={"batch_mode": "documents"})
    assert window_at(documents.train, documents.model.block_size, 10, 0) == documents.model.block_size
