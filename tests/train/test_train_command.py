"""`tinylm train` and `tinylm eval` as a user runs them: real processes, real files, real exit codes."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import tomllib

import matplotlib.image
import pytest
import torch
from diskkit import refused
from trainkit import cli_flags, run_cli, tiny_config

from tinylm.cli import main
from tinylm.lock import LOCK_FILE
from tinylm.run import checkpoint_path, load_checkpoint, read_metrics
from tinylm.train import train
from tinylm.train.loop import _Trainer


@pytest.mark.slow
def test_train_end_to_end_writes_the_run_and_prints_a_sample(tmp_path, corpus, data_dir):
    out = tmp_path / "run"
    done = run_cli("train", *cli_flags(corpus, data_dir, sample_tokens=40), "--out", str(out))
    assert done.returncode == 0, done.stderr
    text = done.stdout
    assert "parameters" in text and "MFLOPs per token" in text  # the model's size and cost, at the start
    assert "step 4/8 | loss" in text  # not a terminal: plain progress lines
    assert "bits per byte (the whole validation split" in text
    assert f"checkpoint: {checkpoint_path(out, 'latest')}" in text
    assert "sample (40 tokens at most" in text
    for name in ("config.toml", "tokenizer.json", "metrics.jsonl", "loss.png", "run.json"):
        assert (out / name).is_file(), name
    for name in ("latest", "best"):
        assert (out / "checkpoints" / name / "state.json").is_file()
    png = (out / "loss.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert matplotlib.image.imread(out / "loss.png").shape[2] in (3, 4)
    saved = tomllib.loads((out / "config.toml").read_text())
    assert saved["model"]["n_layer"] == 2 and saved["train"]["batch_size"] == 4
    assert saved["model"]["vocab_size"] == load_checkpoint(checkpoint_path(out)).tokenizer.vocab_size
    rows = read_metrics(out)
    assert [r["step"] for r in rows if r["kind"] == "train"] == list(range(1, 9))
    assert {r["step"] for r in rows if r["kind"] == "eval"} == {4, 8}
    final = json.loads((out / "run.json").read_text())["final"]
    # `tinylm eval` on the latest checkpoint reproduces the final numbers
    evaluated = run_cli("eval", str(out), "--checkpoint", "latest")
    assert evaluated.returncode == 0, evaluated.stderr
    assert f"{final['bits_per_byte']:.4f} bits per byte" in evaluated.stdout


@pytest.mark.slow
def test_a_hard_kill_then_resume_ends_with_the_weights_of_an_uninterrupted_run(tmp_path, corpus, data_dir):
    settings = dict(max_steps=150, checkpoint_interval=10, eval_interval=1000, log_interval=50)
    out = tmp_path / "killed"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "tinylm", "train", *cli_flags(corpus, data_dir, **settings),
                             "--out", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    state = checkpoint_path(out, "latest") / "state.json"
    deadline = time.monotonic() + 120
    while not state.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)  # no cleanup, no goodbye: mid-step, or even mid-save
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read().decode()
    killed_at = load_checkpoint(checkpoint_path(out)).step
    assert 10 <= killed_at < 150
    assert (out / LOCK_FILE).exists()  # the killed process's lock, free now: the resume below takes it over
    resumed = run_cli("train", "--out", str(out), "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming at step {killed_at} of" in resumed.stdout

    straight = train(tiny_config(corpus, data_dir, **settings), tmp_path / "straight", progress=False,
                     log=lambda line: None)
    a, b = load_checkpoint(straight.checkpoint), load_checkpoint(checkpoint_path(out))
    assert a.step == b.step == 150
    for name, tensor in a.model_state().items():
        assert torch.equal(tensor, b.model_state()[name]), name
    opt_a, opt_b = a.optimizer_state()["state"], b.optimizer_state()["state"]
    for key in opt_a:
        for name, value in opt_a[key].items():
            assert torch.equal(value, opt_b[key][name]), (key, name)


# ----- errors: one line on stderr, exit status 2, nothing lost ------------------------------------------


@pytest.fixture(scope="module")
def half_run(tmp_path_factory, corpus, data_dir):
    """A run stopped after 4 of its 8 steps; tests get their own copy to break."""
    out = tmp_path_factory.mktemp("half") / "run"
    train(tiny_config(corpus, data_dir), out, stop_after=4, progress=False, log=lambda line: None)
    return out


@pytest.fixture
def run_copy(tmp_path, half_run):
    target = tmp_path / "run"
    shutil.copytree(half_run, target)
    return target


def test_a_missing_or_empty_corpus(tmp_path, capsys, corpus, data_dir):
    flags = cli_flags(corpus, tmp_path / "data")
    at = flags.index("--corpus") + 1
    flags[at] = str(tmp_path / "no-such-file.txt")
    refused(capsys, ["train", *flags, "--out", str(tmp_path / "a")], "does not exist")
    (tmp_path / "empty.txt").write_text("")
    flags[at] = str(tmp_path / "empty.txt")
    refused(capsys, ["train", *flags, "--out", str(tmp_path / "b")], "is empty")


def test_an_existing_run_is_not_overwritten(capsys, run_copy, corpus, data_dir):
    before = (checkpoint_path(run_copy) / "model.safetensors").read_bytes()
    refused(capsys, ["train", *cli_flags(corpus, data_dir), "--out", str(run_copy)], "already exists; continue that run with --resume")
    assert (checkpoint_path(run_copy) / "model.safetensors").read_bytes() == before


def test_resuming_with_another_tokenizer_or_configuration(tmp_path, capsys, run_copy):
    other = tmp_path / "other.json"
    from tinylm.tokenizers import CharTokenizer

    CharTokenizer.train("a completely different alphabet: xyz").save(other)
    refused(capsys, ["train", "--out", str(run_copy), "--resume", "--tokenizer", str(other)],
            "does not match the one this run was trained with")
    refused(capsys, ["train", "--out", str(run_copy), "--resume", "--n-layer", "3"],
            "was trained with another configuration ([model] n_layer: 2 -> 3)")


def test_a_corrupt_checkpoint_names_the_file_and_the_other_checkpoint(capsys, run_copy):
    weights = checkpoint_path(run_copy) / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: len(weights.read_bytes()) // 2])
    line = refused(capsys, ["train", "--out", str(run_copy), "--resume"], "truncated")
    assert str(weights) in line and "use the other checkpoint" in line
    # the other checkpoint still works
    assert main(["train", "--out", str(run_copy), "--resume", "best", "--no-progress"]) == 0


def test_a_non_finite_loss_and_out_of_memory(tmp_path, capsys, monkeypatch, corpus, data_dir):
    flags = cli_flags(corpus, data_dir, optimizer="sgd", lr=1e30, warmup_steps=0, grad_clip=0.0)
    refused(capsys, ["train", *flags, "--out", str(tmp_path / "nan")], "at step")

    def too_big(self, step):
        raise MemoryError()

    monkeypatch.setattr(_Trainer, "_train_step", too_big)
    refused(capsys, ["train", *cli_flags(corpus, data_dir), "--out", str(tmp_path / "oom")],
            "out of memory on cpu with batch_size 4 x block_size 32: lower batch_size")


def test_bad_settings(tmp_path, capsys, corpus, data_dir):
    base = ["train", "--out", str(tmp_path / "x"), *cli_flags(corpus, data_dir)]
    refused(capsys, base + ["--lr", "fast"], "--lr expects a number")
    refused(capsys, base + ["--batch-mode", "shuffled"], "must be one of 'packed', 'documents'")
    refused(capsys, base + ["--warmup-steps", "-3"], "warmup_steps must be 0 or more")
    refused(capsys, base + ["--max-steps", "none"], "no training budget")
    with pytest.raises(SystemExit) as exit_info:  # a misspelt flag: argparse's one line, status 2
        main(base + ["--n-layers", "3"])
    assert exit_info.value.code == 2
    assert "unrecognized arguments: --n-layers" in capsys.readouterr().err


def test_help_lists_every_setting(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--help"])
    assert exit_info.value.code == 0
    page = capsys.readouterr().out
    for flag in ("--resume", "--force", "--init-from", "--n-layer", "--lr", "--max-tokens", "--batch-mode",
                 "--grad-accum", "--parallel", "--compile"):
        assert flag in page
