"""Absurd sizes given to `tinylm train` (flags, a --config TOML) are one line before any data work, and the
out-of-memory advice never asks for more memory than the run already used."""

from __future__ import annotations

import dataclasses
import re

import pytest
from diskkit import refused
from trainkit import cli_flags, tiny_config

from tinylm.model import memory
from tinylm.train.progress import out_of_memory_advice


# The corpus does not exist and the data folder is never made: the refusal comes before any data work.
def train_argv(tmp_path, *flags: str) -> list[str]:
    base = cli_flags(tmp_path / "no-corpus", tmp_path / "no-data")
    return ["train", "--out", str(tmp_path / "run"), *base, *flags]


@pytest.mark.parametrize("flags, field", [
    (["--n-layer", "100000000"], "n_layer"),
    (["--d-model", "10000000", "--n-head", "1"], "d_model"),
    (["--d-ff", "1000000000000"], "d_ff"),
    (["--d-head", "100000000000"], "d_head"),
    (["--bigram-hash", "1000000000000"], "bigram_hash"),
    (["--block-size", "1000000000000", "--positions", "rope"], "block_size"),
    (["--grad-accum", "1000000000"], "grad_accum"),
], ids=lambda value: value[0] if isinstance(value, list) else None)
def test_absurd_sizes_from_flags_are_refused_before_the_data(tmp_path, capsys, flags, field):
    line = refused(capsys, train_argv(tmp_path, *flags))
    assert f"more than this machine's {memory.format_bytes(memory.machine_memory())} of memory" in line
    assert re.search(rf"lower {field} \(now {flags[1]}\b", line), line
    assert not (tmp_path / "no-data").exists() and not (tmp_path / "run").exists()


def test_absurd_sizes_from_a_config_file_are_refused_the_same_way(tmp_path, capsys):
    toml = tmp_path / "huge.toml"
    toml.write_text("[model]\nn_layer = 100000000\n\n[train]\nmax_steps = 10\n")
    line = refused(capsys, ["train", "--config", str(toml), "--out", str(tmp_path / "run"),
                            "--corpus", str(tmp_path / "no-corpus"), "--data-dir", str(tmp_path / "no-data")])
    assert "for its weights alone" in line and "lower n_layer (now 100000000" in line
    assert not (tmp_path / "no-data").exists() and not (tmp_path / "run").exists()


def test_a_narrow_model_of_absurd_depth_is_refused_for_its_build_time(tmp_path, capsys):
    line = refused(capsys, train_argv(tmp_path, "--n-layer", "20000", "--d-model", "8", "--n-head", "1"))
    assert "n_layer 20000 is more layers than any language model has" in line
    assert f"use at most {memory.MAX_LAYERS:,}" in line


def test_the_grad_accum_that_could_fit_is_named_and_fits(tmp_path, capsys, monkeypatch):
    # a machine of 2 GB: the largest grad_accum the message names fits it, one more does not
    monkeypatch.setattr(memory, "machine_memory", lambda: 2 * 10**9)
    line = refused(capsys, train_argv(tmp_path, "--grad-accum", "10000000"))
    most = int(re.search(r"at most ([\d,]+) could fit", line)[1].replace(",", ""))
    config = tiny_config(tmp_path, tmp_path)

    def total(grad_accum: int) -> int:
        train = dataclasses.replace(config.train, grad_accum=grad_accum)
        return sum(memory.memory_parts(config.model, train).values())

    assert total(most) <= 2 * 10**9 < total(most + 1)


def advised(advice: str, flag: str) -> int | None:
    found = re.search(rf"--{flag} (\d+)", advice)
    return int(found[1]) if found else None


@pytest.mark.parametrize("batch_size, grad_accum", [(4, 1), (6, 3), (3, 5), (1, 1), (1, 8), (12, 1_000_000_000)])
def test_the_out_of_memory_advice_never_asks_for_more(tmp_path, batch_size, grad_accum):
    config = tiny_config(tmp_path, tmp_path, batch_size=batch_size, grad_accum=grad_accum)
    advice = out_of_memory_advice(config, "cpu")
    new_batch, new_accum = advised(advice, "batch-size"), advised(advice, "grad-accum")
    assert advice.startswith("out of memory on cpu") and "\n" not in advice
    if new_batch is not None:  # a smaller micro-batch, and never more rows per step than before
        assert new_batch < batch_size and new_batch * new_accum <= batch_size * grad_accum
    elif new_accum is not None:  # the step's own rows are what fills the memory
        assert new_accum < grad_accum
    else:  # batch_size 1 already: the context or the model must shrink
        assert batch_size == 1 and advised(advice, "block-size") < config.model.block_size
    if grad_accum == 1_000_000_000:  # the advised step's token ids fit in half the memory
        assert new_batch is None and "lower grad_accum" in advice
        step_ids = batch_size * new_accum * config.model.block_size * memory.STEP_BATCH_BYTES_PER_TOKEN
        assert step_ids <= memory.machine_memory() // 2
