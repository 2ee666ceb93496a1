"""A run meets a disk that refuses writes, and damaged checkpoints: one line each, never a traceback.

A full disk (a real small tmpfs, see `diskkit`) under a checkpoint write, the copy to best/, or the
files a resumed run rewrites is one line naming what could not be written and what is still intact,
exit status 2, and no half-written folder left; once there is room, the advice in the line works.
Weights rewritten as integers (checksums recomputed, so they pass verification) are refused naming
the tensor, and a checkpoints/latest that is a symbolic link is replaced without touching its target.
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

import pytest
import torch
from diskkit import fill, leftovers, read_only, refused, small_disk
from trainkit import tiny_config

from tinylm.atomic import disk_writes
from tinylm.cli import main
from tinylm.errors import TinyLMError
from tinylm.run import checkpoint_path, copy_checkpoint, load_checkpoint, save_checkpoint, verify_checkpoint
from tinylm.train import train


@pytest.fixture(scope="module")
def trained(tmp_path_factory, corpus, data_dir) -> Path:
    """A run stopped after 4 of 8 steps: latest and best both at step 4."""
    out = tmp_path_factory.mktemp("disk-failures") / "run"
    train(tiny_config(corpus, data_dir), out, stop_after=4, progress=False, log=lambda line: None)
    return out


@pytest.fixture
def disk(tmp_path) -> Path:
    with small_disk(tmp_path / "disk") as mounted:
        yield mounted


def run_on(folder: Path, trained: Path) -> Path:
    run = folder / "run"
    shutil.copytree(trained, run)
    return run


def save_again(folder: Path, **change) -> None:
    """Save the checkpoint at ``folder`` over itself, its weights changed by ``change["weights"]`` if given."""
    ckpt = load_checkpoint(folder)
    weights = change.get("weights", lambda w: w)(ckpt.model_state())
    save_checkpoint(folder, model_state=weights, optimizer_state=ckpt.optimizer_state(), rng_state=ckpt.rng_state(),
                    state=ckpt.state, config=ckpt.config, tokenizer=ckpt.tokenizer)


def test_a_checkpoint_write_on_a_full_disk_keeps_the_last_checkpoint_and_resume_continues(capsys, disk, trained):
    run = run_on(disk, trained)
    fill(disk, leave=120_000)  # room for the small files a resumed run rewrites, not for a checkpoint
    latest = checkpoint_path(run, "latest")
    line = refused(capsys, ["train", "--out", str(run), "--resume", "--no-progress"])
    assert line == (f"cannot write checkpoint {latest}: no space left on device; the checkpoint of step 4 is intact "
                    "there; free some space and continue with --resume")
    assert leftovers(run) == []  # no .latest.new, no temporary file
    assert load_checkpoint(verify_checkpoint(latest)).step == 4
    (disk / "filler").unlink()
    assert main(["train", "--out", str(run), "--resume", "--no-progress"]) == 0  # the advice works
    assert load_checkpoint(latest).step == 8


def test_a_resumed_run_on_a_full_disk_is_one_line(capsys, disk, trained):
    run = run_on(disk, trained)
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    fill(disk, leave=8192)
    line = refused(capsys, ["train", "--out", str(run), "--resume", "--no-progress"])
    assert line.startswith(f"cannot write {run}/") and ": no space left on device; the " in line, line
    assert "there before is intact; free some space and try again" in line, line
    assert leftovers(run) == []
    # what the failed write was to replace is whole (metrics.jsonl may be cut back to the checkpoint's step)
    name = line.removeprefix(f"cannot write {run}/").split(":")[0]
    assert (run / name).read_bytes() == before[name]


def test_the_copy_to_best_on_a_full_disk_keeps_both_checkpoints(disk, trained):
    run = run_on(disk, trained)
    fill(disk)
    best = checkpoint_path(run, "best")
    with pytest.raises(TinyLMError) as e:
        copy_checkpoint(checkpoint_path(run, "latest"), best)
    assert str(e.value) == (f"cannot write checkpoint {best}: no space left on device; the checkpoint of step 4 is "
                            "intact there; free some space and continue with --resume")
    assert leftovers(run) == []
    for name in ("latest", "best"):
        verify_checkpoint(checkpoint_path(run, name))


def test_a_checkpoint_write_on_a_read_only_disk_is_one_line(disk, trained):
    run = run_on(disk, trained)
    read_only(disk)
    latest = checkpoint_path(run, "latest")
    with pytest.raises(TinyLMError) as e:
        save_again(latest)
    assert str(e.value) == (f"cannot write checkpoint {latest}: the file system is read-only; the checkpoint of step 4 "
                            "is intact there; make it writable or write somewhere else and continue with --resume")


@pytest.mark.parametrize("code, why", [
    (errno.ENOSPC, "no space left on device; the old file is intact; free some space and try again"),
    (errno.EDQUOT, "the disk quota is exceeded; the old file is intact; free some space or raise the quota and "
                   "try again"),
    (errno.EROFS, "the file system is read-only; the old file is intact; make it writable or write somewhere else "
                  "and try again"),
    (errno.EACCES, "permission denied; the old file is intact; make the folder writable for you or write somewhere "
                   "else and try again"),
    (errno.EPERM, "operation not permitted; the old file is intact; make the folder writable for you or write "
                  "somewhere else and try again"),
], ids=errno.errorcode.get)
def test_every_disk_failure_is_one_line(code, why):
    # (root writes through any permission, so EACCES and EPERM cannot be met on a real folder here)
    with pytest.raises(TinyLMError) as e, disk_writes("x.bin", "the old file is intact"):
        raise OSError(code, "refused", "x.bin")
    assert str(e.value) == f"cannot write x.bin: {why}"
    # numpy's tofile says a write the disk cut short without an errno
    with pytest.raises(TinyLMError, match="^cannot write x.bin: no space left on device; the old file is intact"), \
            disk_writes("x.bin", "the old file is intact"):
        raise OSError("9664 requested and 288 written")
    with pytest.raises(IsADirectoryError), disk_writes("x.bin", "the old file is intact"):
        raise IsADirectoryError(errno.EISDIR, "not a disk failure", "x.bin")  # not a disk failure: as it was


def test_a_symlinked_latest_is_replaced_and_its_target_left_alone(tmp_path, trained):
    run = run_on(tmp_path, trained)
    latest = checkpoint_path(run, "latest")
    target = tmp_path / "elsewhere"
    shutil.move(latest, target)
    latest.symlink_to(target, target_is_directory=True)  # a user's `ln -s`
    kept = {p.name: p.read_bytes() for p in target.iterdir()}
    for _ in range(2):  # the second save is the one a left-over link used to break
        save_again(latest, weights=lambda w: {k: v + 1 for k, v in w.items()})
        assert latest.is_dir() and not latest.is_symlink()
        assert sorted(p.name for p in latest.parent.iterdir()) == ["best", "latest"]
    assert {p.name: p.read_bytes() for p in target.iterdir()} == kept
    assert load_checkpoint(latest).step == 4


def test_integer_weights_with_recomputed_checksums_are_refused_naming_the_tensor(capsys, tmp_path, trained):
    run = run_on(tmp_path, trained)
    best = checkpoint_path(run, "best")
    save_again(best, weights=lambda w: {k: (v * 1000).to(torch.int32) for k, v in w.items()})
    verify_checkpoint(best)  # the checksums match: only the dtype gives it away
    line = refused(capsys, ["eval", str(run)])
    assert line.startswith(f"the weights in {best / 'model.safetensors'} are not a model's: ") and \
        " holds int32 values where a model holds floating-point numbers (float32, bfloat16, float16, float64); " \
        f"use the other checkpoint, {checkpoint_path(run, 'latest')}" in line, line


def test_a_disk_failure_in_a_write_nothing_wraps_is_still_one_line(capsys, monkeypatch):
    import tinylm.cli.data

    def full(args):
        raise OSError(errno.ENOSPC, "No space left on device", "data/x/somewhere.bin")

    monkeypatch.setattr(tinylm.cli.data, "cmd_prepare", full)
    line = refused(capsys, ["prepare", "--corpus", "stdlib"])
    assert line == "cannot write data/x/somewhere.bin: no space left on device; free some space and try again"

    def quota(args):
        raise OSError(errno.EDQUOT, "Disk quota exceeded")  # os.write on a descriptor: no file name

    monkeypatch.setattr(tinylm.cli.data, "cmd_prepare", quota)
    line = refused(capsys, ["prepare", "--corpus", "stdlib"])
    assert line == "a write failed: the disk quota is exceeded; free some space or raise the quota and try again"
