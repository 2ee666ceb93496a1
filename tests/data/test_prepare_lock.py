"""Two `tinylm prepare` processes into one folder at once: the folder lock lets one write, the other stops.

`tinylm prepare` does not wait for a folder another process is writing (`tinylm train` preparing its data
does): the second process exits with status 2 and one line naming the holder, having written nothing. The
first finishes as if alone, and the folder then holds exactly what a lone prepare writes: the shards open,
no temporary file or lock is left, and a prepare run again reuses them.

The processes are real (``python -m tinylm prepare``) on a small JSONL corpus. To be sure the second one
meets the lock, the first is paused (SIGSTOP) while it holds it, as a slow disk or a busy machine would
stretch its work; a second test starts both together and lets them race, with either ending allowed.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from diskkit import leftovers, one_error_line

from tinylm.cli import main
from tinylm.data.shards import SHARD_FILES, ShardSet
from tinylm.lock import LOCK_FILE

WORDS = ("to be or not that is the question whether tis nobler in the mind to suffer the slings and arrows of "
         "outrageous fortune or to take arms against a sea of troubles").split()
TIMEOUT = 120  # seconds for any one process: a start-up with torch on a busy machine, and a second of work


@pytest.fixture
def corpus(tmp_path) -> Path:
    """300 documents of 60 words, about 90 kB: a prepare takes a fraction of a second once started."""
    rng = random.Random(0)
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": " ".join(rng.choices(WORDS, k=60)) + f" {i}."}) + "\n"
                            for i in range(300)), encoding="utf-8")
    return path


def prepare_args(corpus: Path, out: Path) -> list[str]:
    return ["prepare", "--corpus", str(corpus), "--kind", "bpe", "--vocab-size", "400", "--workers", "1",
            "--out", str(out)]


def start(corpus: Path, out: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tinylm", *prepare_args(corpus, out)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=out.parent,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


def finish(proc: subprocess.Popen) -> tuple[int, str, str]:
    stdout, stderr = proc.communicate(timeout=TIMEOUT)
    return proc.returncode, stdout, stderr


def stop_all(*procs: subprocess.Popen) -> None:
    """Kill whatever is still running (paused or not) after a failed check: no test leaves a process behind."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)


def holder(out: Path) -> int | None:
    """The pid in the folder's lock file: written only once that process holds the lock, removed before it lets
    go (so while the file names a process, that process holds the lock)."""
    try:
        return int(json.loads((out / LOCK_FILE).read_text(encoding="utf-8"))["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None  # no lock file, or one just made and not yet written


def paused_while_holding_the_lock(proc: subprocess.Popen, out: Path) -> bool:
    """Pause ``proc`` (SIGSTOP) once it holds ``out``'s lock: True if it still held it when it stopped; False if it
    ended first (it works for a fraction of a second), and then it is left to end."""
    deadline = time.monotonic() + TIMEOUT
    while holder(out) != proc.pid:
        if proc.poll() is not None:
            return False
        assert time.monotonic() < deadline, "the prepare never took the lock"
        time.sleep(0.001)
    proc.send_signal(signal.SIGSTOP)
    while (now := state(proc)) not in ("T", "Z", None):  # the signal is sent; the process stops a moment later
        assert time.monotonic() < deadline, "the prepare did not stop on SIGSTOP"
        time.sleep(0.001)
    if now == "T" and holder(out) == proc.pid:
        return True
    proc.send_signal(signal.SIGCONT)
    return False


def state(proc: subprocess.Popen) -> str | None:
    """The process's state letter from /proc (T: stopped), or None once it has ended."""
    try:
        return Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    """Every file in ``folder`` (hidden ones too) with its size and modification time."""
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.iterdir()}


def assert_as_if_prepared_alone(out: Path, corpus: Path, tmp_path: Path, capsys) -> None:
    """``out`` holds the four files a lone prepare writes, byte for byte, and nothing else; they open as shards,
    and a prepare run again reuses them."""
    alone = tmp_path / "alone"
    assert main(prepare_args(corpus, alone)) == 0
    assert sorted(p.name for p in out.iterdir()) == sorted(SHARD_FILES), leftovers(out)  # no lock, no temporaries
    for name in SHARD_FILES:
        assert (out / name).read_bytes() == (alone / name).read_bytes(), name
    shards = ShardSet.open(out)
    assert shards.num_tokens("train") > 0 and shards.num_tokens("val") > 0
    assert shards.tokenizer().vocab_size == 400
    capsys.readouterr()
    assert main(prepare_args(corpus, out)) == 0
    assert f"reused: token shards in {out}" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == sorted(SHARD_FILES)


def test_a_second_prepare_into_a_folder_being_written_is_refused_and_the_first_finishes(tmp_path, corpus, capsys):
    for attempt in range(5):  # a try where the first finished before it could be paused proves nothing: again
        out = tmp_path / f"shards-{attempt}"
        first = start(corpus, out)
        try:
            if not paused_while_holding_the_lock(first, out):
                assert finish(first)[0] == 0
                continue
            before = snapshot(out)  # whatever the first has written so far, and its lock file
            second = start(corpus, out)
            try:
                code, stdout, stderr = finish(second)
            finally:
                stop_all(second)
            line = one_error_line(code, stdout + stderr)  # and nothing on stdout
            holder_named = f"{out} is in use by another tinylm process (pid {first.pid}, `tinylm prepare "
            assert line.startswith(holder_named), line
            assert line.endswith("wait for it to end, or stop it, then try again"), line
            assert snapshot(out) == before  # the refused process wrote, removed and renamed nothing

            first.send_signal(signal.SIGCONT)
            code, stdout, stderr = finish(first)
        finally:
            stop_all(first)
        assert code == 0 and "Traceback" not in stderr, stderr
        assert f"token shards in {out}" in stdout and "wrote in" in stdout, stdout
        break
    else:
        pytest.fail("in 5 tries the first prepare always finished before it could be paused holding the lock")
    assert_as_if_prepared_alone(out, corpus, tmp_path, capsys)


def test_two_prepares_started_together_end_with_one_folder_of_shards(tmp_path, corpus, capsys):
    out = tmp_path / "shards"
    procs = [start(corpus, out), start(corpus, out)]
    try:
        ends = [finish(proc) for proc in procs]
    finally:
        stop_all(*procs)
    # one writes; the other either met the lock (status 2, one line naming the writer) or came after it and
    # reused its tokenizer and shards
    wrote = [i for i, (code, stdout, _) in enumerate(ends) if code == 0 and "wrote in" in stdout]
    assert len(wrote) == 1, ends
    writer = procs[wrote[0]]
    code, stdout, stderr = ends[1 - wrote[0]]
    if code != 0:
        line = one_error_line(code, stdout + stderr)
        assert line.startswith(f"{out} is in use by another tinylm process (pid {writer.pid}, "), line
    else:
        assert code == 0 and "Traceback" not in stderr, stderr
        assert f"reusing the tokenizer in {out / 'tokenizer.json'}" in stdout, stdout
        assert f"reused: token shards in {out}" in stdout, stdout
    assert_as_if_prepared_alone(out, corpus, tmp_path, capsys)
