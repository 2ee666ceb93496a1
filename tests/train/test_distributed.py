"""torchrun with 2 processes on the CPU (gloo): the same training as one process on the same global batch."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
import torch
from trainkit import cli_flags, tiny_config

from tinylm.run import checkpoint_path, load_checkpoint, read_metrics
from tinylm.train import train

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
               "--master-port", str(free_port()), "-m", "tinylm", "train", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done


def losses(run_dir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if r["kind"] == "train"}


def assert_same_training(one_dir, two_dir, atol=1e-5):
    a, b = losses(one_dir), losses(two_dir)
    assert a.keys() == b.keys() and len(a) == 6
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-4), step
    wa = load_checkpoint(checkpoint_path(one_dir)).model_state()
    wb = load_checkpoint(checkpoint_path(two_dir)).model_state()
    for name in wa:
        torch.testing.assert_close(wb[name], wa[name], rtol=1e-4, atol=atol)


SETTINGS = dict(max_steps=6, batch_size=4, eval_interval=3, dropout=0.0)


def test_ddp_on_two_processes_follows_one_process_on_the_same_global_batch(tmp_path, corpus, data_dir):
    one = train(tiny_config(corpus, data_dir, **SETTINGS), tmp_path / "one", progress=False, log=lambda line: None)
    done = torchrun(*cli_flags(corpus, data_dir, **SETTINGS), "--out", str(tmp_path / "two"))
    assert "2 processes (ddp)" in done.stdout
    assert done.stdout.count("tinylm train: training run") == 1  # process 0 alone logs
    assert_same_training(one.run_dir, tmp_path / "two")
    final = [r for r in read_metrics(tmp_path / "two") if r["kind"] == "final"][0]
    assert final["val_loss"] == pytest.approx(one.val["loss"], rel=1e-4)  # evaluation summed over processes


def test_fsdp_shards_the_same_training_and_its_checkpoint_resumes_in_one_process(tmp_path, corpus, data_dir):
    one = train(tiny_config(corpus, data_dir, **SETTINGS), tmp_path / "one", progress=False, log=lambda line: None)
    done = torchrun(*cli_flags(corpus, data_dir, **SETTINGS), "--parallel", "fsdp", "--stop-after", "4",
                    "--out", str(tmp_path / "two"))
    assert "2 processes (fsdp)" in done.stdout and "stopped after step 4 of 6" in done.stdout
    # the sharded run's checkpoint holds whole tensors keyed by name: one process can pick it up
    train(None, tmp_path / "two", resume=True, progress=False, log=lambda line: None)
    assert_same_training(one.run_dir, tmp_path / "two")


def test_an_lstm_trains_under_ddp_as_in_one_process(tmp_path, corpus, data_dir):
    settings = {**SETTINGS, "family": "lstm", "bptt": 8}
    one = train(tiny_config(corpus, data_dir, **settings), tmp_path / "one", progress=False, log=lambda line: None)
    done = torchrun(*cli_flags(corpus, data_dir, **settings), "--out", str(tmp_path / "two"))
    assert "2 processes (ddp)" in done.stdout and "LSTM, 2 layers of width 32" in done.stdout
    assert_same_training(one.run_dir, tmp_path / "two")


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_muon_trains_under_ddp_and_fsdp_as_in_one_process(tmp_path, corpus, data_dir, parallel):
    # Muon orthogonalizes each whole matrix: under FSDP every process must see the full gradient, not a shard
    settings = {**SETTINGS, "optimizer": "muon", "muon_lr": 0.05, "muon_momentum_warmup": 4}
    one = train(tiny_config(corpus, data_dir, **settings), tmp_path / "one", progress=False, log=lambda line: None)
    done = torchrun(*cli_flags(corpus, data_dir, **settings), "--parallel", parallel, "--stop-after", "4",
                    "--out", str(tmp_path / "two"))
    assert f"2 processes ({parallel})" in done.stdout and "muon" in done.stdout
    train(None, tmp_path / "two", resume=True, progress=False, log=lambda line: None)  # and resumes in one process
    # The losses agree to 1e-4 at every step. The weights agree less closely than AdamW's: Newton-Schulz
    # pushes every singular value of the momentum towards 1, also those that are rounding noise (the
    # order in which gradients are summed), so a last-bit difference grows to a part of one step's
    # size (muon_lr / sqrt(32) = 0.009 here). One process with grad_accum 2, the same sum in another
    # order, differs from one process by 0.005 in the same way.
    assert_same_training(one.run_dir, tmp_path / "two", atol=1e-2)


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_bfloat16_training_under_ddp_and_fsdp_follows_one_process(tmp_path, corpus, data_dir, parallel):
    # Under bfloat16 autocast a Transformer trains through the sliced head and loss (model/head_loss.py)
    # and the written-out attention backward: DDP's gradient hooks and FSDP's sharded head must see their
    # gradients as they see autograd's own. bfloat16 rounds differently for half a batch than for a
    # whole one, so the agreement is bfloat16's, not float32's.
    settings = {**SETTINGS, "dtype": "bfloat16", "optimizer": "muon", "muon_lr": 0.05}
    one = train(tiny_config(corpus, data_dir, **settings), tmp_path / "one", progress=False, log=lambda line: None)
    done = torchrun(*cli_flags(corpus, data_dir, **settings), "--parallel", parallel, "--out", str(tmp_path / "two"))
    assert f"2 processes ({parallel})" in done.stdout and "bfloat16 autocast" in done.stdout
    a, b = losses(one.run_dir), losses(tmp_path / "two")
    assert a.keys() == b.keys() and len(a) == 6
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-2), step
    assert a[6] < a[1] - 0.05  # it learns
