"""Checkpoint damage as the commands meet it: every way a checkpoint file can go bad is refused.

A file cut short, one bit flipped in any file, a file missing, a file swapped in from another
run, weights that are NaN: `tinylm train --resume`, `train --init-from`, `eval`, `sample`, `serve`
and `export` each stop with one line that names the file and the checkpoint to use instead, and that advice
works because ``best/`` is a copy of ``latest/``, not hard links to the same bytes. Two identical
runs write byte-identical checkpoints, with the permissions of every other file of a run.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
from pathlib import Path

import pytest
import uvicorn
from diskkit import refused
from trainkit import cli_flags, run_cli, tiny_config

from tinylm.cli import main
from tinylm.run import checkpoint_path, load_checkpoint, save_checkpoint
from tinylm.train import train

FILES = ("model.safetensors", "optimizer.safetensors", "rng.safetensors", "state.json", "config.toml",
         "tokenizer.json", "checksums.json")
SIBLING = {"latest": "best", "best": "latest"}


def bpe_flags(corpus: Path, data_dir: Path, **settings) -> list[str]:
    # a byte-level BPE tokenizer, so that the runs can be exported too
    return cli_flags(corpus, data_dir, tokenizer_kind="bpe", tokenizer_vocab_size=300, **settings)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus) -> dict:
    """Two identical runs, each trained by `tinylm train` in its own process and stopped after 4 of 8 steps
    (latest and best both at step 4), and a third from another seed to swap files in from."""
    root = tmp_path_factory.mktemp("integrity")
    flags = bpe_flags(corpus, root / "plays-bpe")
    for name in ("run", "twin"):
        done = run_cli("train", *flags, "--stop-after", "4", "--out", str(root / name))
        assert done.returncode == 0, done.stderr
    train(tiny_config(corpus, root / "plays-bpe", tokenizer_kind="bpe", tokenizer_vocab_size=300, seed=7),
          root / "other", stop_after=4, progress=False, log=lambda line: None)
    return {"flags": flags, **{name: root / name for name in ("run", "twin", "other")}}


@pytest.fixture
def run_copy(tmp_path, runs) -> Path:
    target = tmp_path / "run"
    shutil.copytree(runs["run"], target)
    return target


def flip_a_bit(path: Path, other_run: Path | None = None) -> None:
    """Flip the lowest bit of the middle byte, in place, as a bad sector or a stray write would."""
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0x01]))


def truncate(path: Path, other_run: Path) -> None:
    os.truncate(path, path.stat().st_size - 1000)


def delete(path: Path, other_run: Path) -> None:
    path.unlink()


def swap_in(path: Path, other_run: Path) -> None:
    """Replace the file by the same file of the same checkpoint of ``other_run``."""
    path.write_bytes((checkpoint_path(other_run, path.parent.name) / path.name).read_bytes())


# what is done to which file of the checkpoint (the file the error must name), and what the error calls it
DAMAGES = {
    **{f"truncated {name}": (truncate, name, "truncated")
       for name in ("model.safetensors", "optimizer.safetensors")},
    **{f"a bit flipped in {name}": (flip_a_bit, name, "is corrupt") for name in FILES},
    **{f"missing {name}": (delete, name, "no state.json" if name == "state.json" else "is missing") for name in FILES},
    **{f"{name} of another run": (swap_in, name, "another checkpoint's")
       for name in ("model.safetensors", "optimizer.safetensors", "state.json", "checksums.json")},
}

# each command as a user types it for a run (and the flags it was trained with), and the checkpoint it loads
COMMANDS = {
    "train --resume": (lambda run, flags: ["train", "--out", str(run), "--resume", "--no-progress"], "latest"),
    "train --init-from": (lambda run, flags: ["train", *flags, "--init-from", str(run), "--out", f"{run}-tuned",
                                              "--no-progress"], "best"),
    "eval": (lambda run, flags: ["eval", str(run)], "best"),
    "sample": (lambda run, flags: ["sample", "--run", str(run), "--prompt", "The king", "--max-new-tokens", "4"],
               "best"),
    "serve": (lambda run, flags: ["serve", "--run", str(run), "--port", "0"], "best"),
    "export": (lambda run, flags: ["export", "--run", str(run), "--format", "hf", "--out", f"{run}-hf"], "best"),
}


@pytest.fixture(autouse=True)
def no_server_starts(monkeypatch):
    """A `tinylm serve` that got past loading would serve forever: make that a failure, not a hung test."""
    def started(self, *args, **kwargs):
        raise AssertionError("the server started")
    monkeypatch.setattr(uvicorn.Server, "run", started)


def command(name: str, run_dir: Path, runs: dict) -> list[str]:
    return COMMANDS[name][0](run_dir, runs["flags"])


@pytest.mark.slow
@pytest.mark.parametrize("damage", DAMAGES)
@pytest.mark.parametrize("cmd", COMMANDS)
def test_every_damage_is_refused_by_every_command_naming_the_file_and_the_other_checkpoint(
        capsys, runs, run_copy, cmd, damage):
    how, name, called = DAMAGES[damage]
    which = COMMANDS[cmd][1]
    folder = checkpoint_path(run_copy, which)
    how(folder / name, runs["other"])
    line = refused(capsys, command(cmd, run_copy, runs))
    assert str(folder) in line and name in line and called in line, line
    other = SIBLING[which]
    assert f"use the other checkpoint, {checkpoint_path(run_copy, other)} (--checkpoint {other}, or --resume {other}" \
        in line, line


def test_the_files_swapped_in_differ_from_the_runs_own(runs):
    """Else the swaps above would prove nothing."""
    for name in ("model.safetensors", "optimizer.safetensors", "state.json", "checksums.json"):
        ours, theirs = (checkpoint_path(runs[r], "best") / name for r in ("run", "other"))
        assert ours.read_bytes() != theirs.read_bytes(), name


def test_best_is_a_copy_so_the_advice_to_use_it_works(tmp_path, capsys, corpus, data_dir):
    out = tmp_path / "run"  # trained here, not copied: a copy would break hard links and hide them
    train(tiny_config(corpus, data_dir), out, stop_after=4, progress=False, log=lambda line: None)
    latest, best = checkpoint_path(out, "latest"), checkpoint_path(out, "best")
    for name in FILES:
        a, b = (latest / name).stat(), (best / name).stat()
        assert a.st_ino != b.st_ino and a.st_nlink == b.st_nlink == 1, name
    best_weights = (best / "model.safetensors").read_bytes()
    flip_a_bit(latest / "model.safetensors")
    assert (best / "model.safetensors").read_bytes() == best_weights  # the damage stayed in latest
    line = refused(capsys, ["train", "--out", str(out), "--resume"])
    assert f"{latest / 'model.safetensors'} is corrupt" in line and f"use the other checkpoint, {best}" in line
    assert main(["eval", str(out), "--checkpoint", "best"]) == 0
    assert main(["train", "--out", str(out), "--resume", "best", "--no-progress"]) == 0
    assert load_checkpoint(latest).step == 8  # trained on from best; the damaged latest replaced


def test_with_both_checkpoints_damaged_the_way_out_is_training_again(capsys, run_copy):
    for which in ("latest", "best"):
        flip_a_bit(checkpoint_path(run_copy, which) / "model.safetensors")
    line = refused(capsys, ["eval", str(run_copy)])
    assert "best/model.safetensors is corrupt" in line
    assert "the run has no other sound checkpoint: train again with --force" in line


def test_a_missing_best_is_an_error_not_a_silent_fall_back_to_latest(capsys, run_copy):
    (checkpoint_path(run_copy, "best") / "state.json").unlink()
    line = refused(capsys, ["eval", str(run_copy)])  # before, it loaded latest without a word
    assert f"{checkpoint_path(run_copy, 'best')} is not a complete checkpoint (no state.json)" in line


def nan_weights(folder: Path) -> None:
    """Save the checkpoint at ``folder`` again with one weight NaN: sound files, as a diverged run would write."""
    ckpt = load_checkpoint(folder)
    weights = ckpt.model_state()
    name = next(iter(weights))
    weights[name] = weights[name].clone()
    weights[name][0] = float("nan")
    save_checkpoint(folder, model_state=weights, optimizer_state=ckpt.optimizer_state(), rng_state=ckpt.rng_state(),
                    state=ckpt.state, config=ckpt.config, tokenizer=ckpt.tokenizer)


@pytest.mark.parametrize("cmd", COMMANDS)
def test_nan_weights_are_refused_on_load(capsys, runs, run_copy, cmd):
    which = COMMANDS[cmd][1]
    nan_weights(checkpoint_path(run_copy, which))
    line = refused(capsys, command(cmd, run_copy, runs))
    assert f"the weights in {checkpoint_path(run_copy, which) / 'model.safetensors'} are not finite" in line, line
    assert f"use the other checkpoint, {checkpoint_path(run_copy, SIBLING[which])}" in line


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_identical_runs_write_identical_checkpoint_files(runs):
    for which in ("latest", "best"):
        for name in ("model.safetensors", "optimizer.safetensors", "rng.safetensors", "config.toml", "tokenizer.json"):
            a, b = (checkpoint_path(runs[r], which) / name for r in ("run", "twin"))
            assert sha256(a) == sha256(b), (which, name)


def test_checkpoint_and_exported_files_get_the_usual_permissions(tmp_path, runs):
    umask = os.umask(0)
    os.umask(umask)
    usual = 0o666 & ~umask
    exported = tmp_path / "hf"
    assert main(["export", "--run", str(runs["run"]), "--format", "hf", "--out", str(exported)]) == 0
    assert main(["export", "--run", str(runs["run"]), "--format", "gguf", "--out", str(tmp_path / "m.gguf")]) == 0
    assert main(["import", "--from", str(exported), "--out", str(tmp_path / "imported")]) == 0
    files = [p for p in sorted(runs["run"].rglob("*")) + sorted(exported.iterdir()) + [tmp_path / "m.gguf"]
             + sorted((tmp_path / "imported").rglob("*")) if p.is_file()]
    assert any(p.name == "model.safetensors" for p in files)
    wrong = {str(p): oct(stat.S_IMODE(p.stat().st_mode)) for p in files if stat.S_IMODE(p.stat().st_mode) != usual}
    assert not wrong, f"expected {oct(usual)}: {wrong}"
    assert load_checkpoint(checkpoint_path(tmp_path / "imported", "best")).step == 0  # the import verifies too


def test_a_configuration_that_does_not_fit_the_weights_is_refused_before_allocating(run_copy):
    """A hand-edited d_model = 8000 would allocate 6 GB before the weights were compared (it fits the machine's
    memory, so the size check lets it through). In a checkpoint written before checksums (nothing catches the
    edit earlier) the shapes are compared on PyTorch's meta device first; the command runs under a 3 GB
    address-space limit to prove nothing big was allocated."""
    import json
    import resource
    import subprocess
    import sys

    for name in ("best", "latest"):
        folder = checkpoint_path(run_copy, name)
        (folder / "checksums.json").unlink()
        state = json.loads((folder / "state.json").read_text())
        del state["checksums"]
        (folder / "state.json").write_text(json.dumps(state))
        for config in (folder / "config.toml", run_copy / "config.toml"):
            config.write_text(config.read_text().replace("d_model = 32", "d_model = 8000"))

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))

    done = subprocess.run([sys.executable, "-m", "tinylm", "eval", str(run_copy)], capture_output=True, text=True,
                          timeout=120, preexec_fn=limit)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "does not fit the weights" in lines[0] and "8000" in lines[0], done.stderr


def test_sample_and_next_token_follow_the_advice_to_use_latest(capsys, run_copy):
    flip_a_bit(checkpoint_path(run_copy, "best") / "model.safetensors")
    message = refused(capsys, ["sample", "--run", str(run_copy), "--prompt", "the", "--max-new-tokens", "3"])
    assert "--checkpoint latest" in message
    for argv in (["sample", "--run", str(run_copy), "--prompt", "the", "--max-new-tokens", "3", "--seed", "1"],
                 ["next-token", "--run", str(run_copy), "--prompt", "the"]):
        assert main([*argv, "--checkpoint", "latest"]) == 0, capsys.readouterr().err
