"""Extending a run: `tinylm train --resume` with a larger budget continues it, bitwise where the schedule allows."""

from __future__ import annotations

import json
import tomllib

import pytest
import torch
from trainkit import cli_flags, run_cli, tiny_config

from tinylm.run import checkpoint_path, load_checkpoint
from tinylm.train import train

WSD = dict(decay="wsd", decay_fraction=0.25, eval_interval=1000, log_interval=5, checkpoint_interval=5)


@pytest.mark.slow
def test_a_wsd_run_extended_before_its_decay_is_the_longer_run_bitwise(tmp_path, corpus, data_dir):
    out = tmp_path / "extended"
    # 20 steps asked for (decay from step 15), stopped at 10, then extended to 30 (decay from step 23)
    done = run_cli("train", *cli_flags(corpus, data_dir, max_steps=20, **WSD), "--out", str(out), "--stop-after", "10")
    assert done.returncode == 0, done.stderr
    done = run_cli("train", "--out", str(out), "--resume", "--max-steps", "30")
    assert done.returncode == 0, done.stderr
    assert "extending the run from 20 to 30 steps (10 done)" in done.stdout
    assert "continues as if 30 steps had been asked for from the start" in done.stdout
    straight = train(tiny_config(corpus, data_dir, max_steps=30, **WSD), tmp_path / "straight", progress=False,
                     log=lambda line: None)
    a, b = load_checkpoint(straight.checkpoint), load_checkpoint(checkpoint_path(out))
    assert a.step == b.step == 30
    for name, tensor in a.model_state().items():
        assert torch.equal(tensor, b.model_state()[name]), name
    # the run now is a 30-step run: its saved settings say so, and resuming again finds it done
    assert tomllib.loads((out / "config.toml").read_text())["train"]["max_steps"] == 30
    assert json.loads((out / "run.json").read_text())["total_steps"] == 30
    again = run_cli("train", "--out", str(out), "--resume")
    assert again.returncode == 0 and "already trained: 30 of 30 steps" in again.stdout


@pytest.mark.slow
def test_a_finished_cosine_run_is_stretched_and_says_so(tmp_path, corpus, data_dir):
    out = tmp_path / "cosine"
    done = run_cli("train", *cli_flags(corpus, data_dir, max_steps=8), "--out", str(out))
    assert done.returncode == 0, done.stderr
    done = run_cli("train", "--out", str(out), "--resume", "--max-steps", "12")
    assert done.returncode == 0, done.stderr
    assert "extending the run from 8 to 12 steps (8 done): the cosine schedule is stretched" in done.stdout
    assert "step 12/12" in done.stdout
    assert load_checkpoint(checkpoint_path(out)).step == 12
    # less than what is done is refused in one line
    fewer = run_cli("train", "--out", str(out), "--resume", "--max-steps", "5")
    assert fewer.returncode == 2 and "already trained 12 steps, more than the 5" in fewer.stderr
    assert len(fewer.stderr.strip().splitlines()) == 1
    # any other setting still may not change
    other = run_cli("train", "--out", str(out), "--resume", "--max-steps", "20", "--lr", "1e-2")
    assert other.returncode == 2 and "[train] lr" in other.stderr
