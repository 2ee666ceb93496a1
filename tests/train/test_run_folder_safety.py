"""A run folder is never lost to tinylm: --force replaces only runs, one process writes a folder at a time,
and a stop by signal keeps the step reached."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from diskkit import refused
from trainkit import cli_flags, tiny_config

from tinylm.cli import main
from tinylm.errors import Stopped, TinyLMError
from tinylm.export.hf_import import import_hf_into_run
from tinylm.lock import LOCK_FILE, folder_lock
from tinylm.run import checkpoint_path, load_checkpoint, read_metrics, read_run_info
from tinylm.train import train
from tinylm.train.stopping import StopRequest


def project_folder(path):
    """A folder of someone's own work that happens to hold a config.toml and a run.json of its own."""
    (path / "src").mkdir(parents=True)
    (path / "src" / "main.py").write_text("print('mine')\n")
    (path / "config.toml").write_text("[tool]\nname = 'mine'\n")
    (path / "run.json").write_text('{"format": "someone-else", "steps": 3}\n')
    (path / "notes.md").write_text("# notes\n")
    return {p.relative_to(path): p.read_bytes() for p in path.rglob("*") if p.is_file()}


def unchanged(path, before) -> bool:
    return {p.relative_to(path): p.read_bytes() for p in path.rglob("*") if p.is_file()} == before


def test_force_never_deletes_a_folder_tinylm_did_not_make(tmp_path, capsys, corpus, data_dir):
    folder = tmp_path / "project"
    before = project_folder(folder)
    for extra in ([], ["--model", "ngram"]):
        line = refused(capsys, ["train", *cli_flags(corpus, data_dir), *extra, "--out", str(folder), "--force"])
        assert "is not a tinylm run folder" in line and "config.toml" in line and "notes.md" in line, line
        assert unchanged(folder, before)
    with pytest.raises(TinyLMError, match="is not a tinylm run folder"):
        import_hf_into_run(tmp_path / "no-such-model", folder, force=True)
    assert unchanged(folder, before)


def test_force_deletes_only_what_a_run_holds(tmp_path, corpus, data_dir):
    out = tmp_path / "run"
    train(tiny_config(corpus, data_dir), out, stop_after=2, progress=False, log=lambda line: None)
    (out / "my-notes.txt").write_text("keep me\n")
    (out / "analysis").mkdir()
    (out / "analysis" / "plot.py").write_text("# mine\n")
    old = (checkpoint_path(out) / "model.safetensors").read_bytes()
    train(tiny_config(corpus, data_dir, seed=1), out, force=True, stop_after=2, progress=False, log=lambda line: None)
    assert (out / "my-notes.txt").read_text() == "keep me\n"
    assert (out / "analysis" / "plot.py").read_text() == "# mine\n"
    assert (checkpoint_path(out) / "model.safetensors").read_bytes() != old  # the run itself was replaced
    assert read_run_info(out)["status"] == "stopped" and not (out / LOCK_FILE).exists()


def test_a_locked_run_or_data_folder_is_refused_with_the_holder_named(tmp_path, capsys, corpus, data_dir):
    out = tmp_path / "run"
    with folder_lock(out, "train"):
        line = refused(capsys, ["train", *cli_flags(corpus, data_dir), "--out", str(out)])
        assert f"{out} is in use by another tinylm process (pid {os.getpid()}" in line, line
    assert not out.exists()  # the lock made the folder, and took it away again
    shards = tmp_path / "shards"
    with folder_lock(shards, "prepare"):
        line = refused(capsys, ["prepare", "--corpus", str(corpus), "--kind", "char", "--out", str(shards)])
        assert "in use by another tinylm process" in line
    assert main(["prepare", "--corpus", str(corpus), "--kind", "char", "--out", str(shards)]) == 0
    assert not (shards / LOCK_FILE).exists()


def test_a_second_writer_can_wait_for_the_first(tmp_path):
    said, order = [], []
    held = threading.Event()

    def first():
        with folder_lock(tmp_path / "data", "prepare"):
            held.set()
            time.sleep(0.3)
            order.append("first done")

    thread = threading.Thread(target=first)
    thread.start()
    assert held.wait(10)
    with folder_lock(tmp_path / "data", "prepare", wait=said.append):
        order.append("second holds")
    thread.join(10)
    assert order == ["first done", "second holds"]
    assert len(said) == 1 and "waiting for another tinylm process" in said[0] and f"pid {os.getpid()}" in said[0]


def test_a_signal_while_stopping_stops_at_once():
    # the handlers before: Python's own, or "ignore" in a process a shell started in the background
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with StopRequest() as stop:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.requested() and stop.name == "SIGINT"
        with pytest.raises(Stopped):
            os.kill(os.getpid(), signal.SIGTERM)
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before  # put back


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_after_the_step_with_a_checkpoint_of_it(tmp_path, capsys, corpus, data_dir, signum):
    # no periodic checkpoint or evaluation: without the clean stop, everything would be lost
    settings = dict(max_steps=100000, checkpoint_interval=100000, eval_interval=100000, log_interval=1)
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "tinylm", "train", *cli_flags(corpus, data_dir, **settings),
                             "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 120
        while len(read_metrics(out)) < 5 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert proc.poll() is None, proc.stderr.read()
        if signum == signal.SIGTERM:  # while it runs, nobody else may write there
            line = refused(capsys, ["train", "--out", str(out), "--resume"])
            assert f"in use by another tinylm process (pid {proc.pid}" in line
        proc.send_signal(signum)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signum, stderr
    assert f"{signal.Signals(signum).name} received: stopping after this step" in stderr
    assert "Traceback" not in stderr
    info = read_run_info(out)
    stopped_at = info["step"]
    assert info["status"] == "stopped" and stopped_at >= 5
    assert f"stopped by {signal.Signals(signum).name} after step {stopped_at} of 100000" in stdout
    assert not (out / LOCK_FILE).exists()
    ckpt = load_checkpoint(checkpoint_path(out))
    assert ckpt.step == stopped_at
    # the weights of that step, exactly: as a run told to stop there has them
    straight = train(tiny_config(corpus, data_dir, **settings), tmp_path / "straight", stop_after=stopped_at,
                     progress=False, log=lambda line: None)
    expected = load_checkpoint(straight.checkpoint).model_state()
    for name, tensor in ckpt.model_state().items():
        assert torch.equal(tensor, expected[name]), name
    if signum == signal.SIGINT:
        resumed = train(None, out, resume=True, stop_after=stopped_at + 2, progress=False, log=lambda line: None)
        assert resumed.step == stopped_at + 2
    assert json.loads((out / "run.json").read_text())["format"] == "tinylm.run"
