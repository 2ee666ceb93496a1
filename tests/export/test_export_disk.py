"""`tinylm export` onto a disk that refuses writes: one line, and nothing half-exported left behind.

A Hugging Face folder is written whole beside its place and renamed in, so a full disk leaves neither
a weights file without its config.json nor a mix of new and old files; a GGUF file is one atomic file.
"""

from __future__ import annotations

import pytest
from diskkit import fill, leftovers, read_only, refused, small_disk
from exportkit import tiny_model

from tinylm.cli import main
from tinylm.export import export_hf, import_hf_into_run

import gguf  # noqa: F401  (in the test extra: absent, this fails rather than skips)


@pytest.fixture(scope="module")
def run(tmp_path_factory, tokenizer):
    """A run to export: a tiny Llama-style model brought in through `tinylm import`."""
    root = tmp_path_factory.mktemp("export-disk")
    export_hf(tiny_model("llama-gqa"), tokenizer, root / "hf")
    import_hf_into_run(root / "hf", root / "run")
    return root / "run"


@pytest.fixture
def disk(tmp_path):
    with small_disk(tmp_path / "disk") as mounted:
        yield mounted


@pytest.mark.parametrize("fmt, out", [("hf", "hf"), ("gguf", "model.gguf")])
def test_export_onto_a_full_disk_is_one_line_and_leaves_nothing(capsys, run, disk, fmt, out):
    fill(disk, leave=8192)  # room for config.json, not for the weights
    line = refused(capsys, ["export", "--run", str(run), "--format", fmt, "--out", str(disk / out)])
    assert line == (f"cannot write the export to {disk / out}: no space left on device; nothing half-written is left; "
                    "free some space and export again")
    assert sorted(p.name for p in disk.iterdir()) == ["filler", "filler-rest"]


def test_export_over_an_earlier_one_on_a_full_disk_replaces_none_of_its_files(capsys, run, disk):
    out = disk / "hf"
    assert main(["export", "--run", str(run), "--format", "hf", "--out", str(out)]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    fill(disk, leave=8192)
    line = refused(capsys, ["export", "--run", str(run), "--format", "hf", "--out", str(out), "--force"])
    assert line == (f"cannot write the export to {out}: no space left on device; nothing was replaced in it; "
                    "free some space and export again")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before and leftovers(out) == []


@pytest.mark.parametrize("fmt, out", [("hf", "hf"), ("gguf", "model.gguf")])
def test_export_onto_a_read_only_disk_is_one_line(capsys, run, disk, fmt, out):
    read_only(disk)
    line = refused(capsys, ["export", "--run", str(run), "--format", fmt, "--out", str(disk / out)])
    assert line.startswith(f"cannot write the export to {disk / out}: the file system is read-only; "), line
