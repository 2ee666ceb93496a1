"""tinylm writes only where the user named: never into a folder another tool made, a run folder, or a
folder that a file read from disk (a run's run.json) points at."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from trainkit import cli_flags, run_cli

from tinylm.run import checkpoint_path


def snapshot(folder):
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def one_line_error(done: subprocess.CompletedProcess, needle: str) -> str:
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], done.stderr
    return lines[0]


def test_prepare_never_replaces_a_tokenizer_json_it_did_not_write(tmp_path, corpus):
    model = tmp_path / "hf-model"  # a Hugging Face model folder: its tokenizer.json is not ours
    model.mkdir()
    (model / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {"type": "BPE"}}))
    before = snapshot(model)
    for force in ([], ["--force"]):
        done = run_cli("prepare", "--corpus", str(corpus), "--kind", "char", "--out", str(model), *force)
        one_line_error(done, "was not written by tinylm")
        assert snapshot(model) == before


def test_prepare_refuses_a_folder_holding_other_files(tmp_path, corpus):
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("my notes")
    done = run_cli("prepare", "--corpus", str(corpus), "--kind", "char", "--out", str(notes))
    one_line_error(done, "holding files tinylm prepare did not write (todo.txt)")
    assert snapshot(notes) == {(notes / "todo.txt").relative_to(notes): b"my notes"}
    # its own folder, made by a prepare before, is fine (and reused)
    shards = tmp_path / "shards"
    for _ in range(2):
        done = run_cli("prepare", "--corpus", str(corpus), "--kind", "char", "--out", str(shards))
        assert done.returncode == 0, done.stderr
    assert "reused" in done.stdout


@pytest.mark.slow
def test_train_puts_no_shards_into_a_run_folder(tmp_path, corpus, data_dir):
    ref = tmp_path / "runs" / "ref"
    done = run_cli("train", *cli_flags(corpus, data_dir, max_steps=2, eval_interval=2), "--out", str(ref))
    assert done.returncode == 0, done.stderr
    before = snapshot(ref)
    flags = cli_flags(corpus, ref, max_steps=2, eval_interval=2)  # --data-dir runs/ref
    done = run_cli("train", *flags, "--out", str(tmp_path / "runs" / "new"))
    one_line_error(done, "is a run folder")
    assert snapshot(ref) == before
    done = run_cli("prepare", "--corpus", str(corpus), "--kind", "char", "--out", str(ref))
    one_line_error(done, "is a run folder")
    assert snapshot(ref) == before


@pytest.mark.slow
def test_resume_never_writes_where_run_json_points(tmp_path, corpus):
    out = tmp_path / "run"
    flags = cli_flags(corpus, tmp_path, max_steps=400, checkpoint_interval=5, eval_interval=1000, log_interval=100)
    i = flags.index("--data-dir")
    del flags[i:i + 2]  # the default data folder, data/<corpus>-char under the working folder
    proc = subprocess.Popen([sys.executable, "-m", "tinylm", "train", *flags, "--out", str(out)], cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env={**os.environ, "OMP_NUM_THREADS": "1"})
    state = checkpoint_path(out, "latest") / "state.json"
    deadline = time.monotonic() + 120
    while not state.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)  # a run stopped part way, to be resumed
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read().decode()
    # the run's record of its data folder is edited to point elsewhere: an empty folder of someone else's
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    info = json.loads((out / "run.json").read_text())
    assert info["data"]["dir"] != str(elsewhere) and (tmp_path / info["data"]["dir"]).is_dir()
    info["data"]["dir"] = str(elsewhere)
    (out / "run.json").write_text(json.dumps(info))
    done = run_cli("train", "--out", str(out), "--resume", cwd=tmp_path)  # as a user would: the run's own settings
    one_line_error(done, "pass --data-dir")
    assert list(elsewhere.iterdir()) == []
    # naming the folder is the user's choice: then it is written
    done = run_cli("train", "--out", str(out), "--resume", "--data-dir", str(elsewhere), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert (elsewhere / "meta.json").is_file()


def test_a_killed_prepare_leaves_no_temporaries_behind(tmp_path, corpus):
    shards = tmp_path / "shards"
    shards.mkdir()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a process id that no longer runs: the prepare that wrote these was killed
    stale = [shards / f".train.bin.{gone.pid}.k3j2h1.tmp", shards / f".meta.json.{gone.pid}.tmp"]
    for path in stale:
        path.write_bytes(b"half a shard")
    done = run_cli("prepare", "--corpus", str(corpus), "--kind", "char", "--out", str(shards))
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in shards.iterdir()) == ["meta.json", "tokenizer.json", "train.bin", "val.bin"]
