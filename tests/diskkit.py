"""A real small disk for the tests of full and read-only disks: a tmpfs mounted for one test.

A tmpfs of a few megabytes fills up in milliseconds, and fails a write with the ENOSPC (or, remounted
read-only, EROFS) a real disk gives, through every layer (Python's buffers, numpy's tofile, safetensors),
which no monkeypatched ``open`` can promise. Mounting needs root, as tinylm's CI runs; elsewhere the
tests that need it are skipped, saying why.

`refused` runs a command that must fail with one error line (`one_error_line`, which also checks the
end of a command run in a subprocess); every test of a refusal uses them.
"""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def small_disk(where: Path, size: str = "4m") -> Iterator[Path]:
    """A tmpfs of ``size`` mounted at ``where`` (made if missing) for the block; unmounted after it."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs to fill up needs root (CI runs the tests as root)")
    where.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=True)


def fill(disk: Path, leave: int = 0) -> None:
    """Write files of zeros on ``disk`` until it is full, then give back ``leave`` bytes: from then on every
    write of more than that fails with ENOSPC."""
    chunk = b"\0" * (64 << 10)
    with open(disk / "filler", "wb", buffering=0) as f:
        try:
            while True:
                f.write(chunk)
        except OSError as e:
            assert e.errno == errno.ENOSPC, e
    # what is left is less than a chunk: fill it to the last byte
    with open(disk / "filler-rest", "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 512)
        except OSError as e:
            assert e.errno == errno.ENOSPC, e
    if leave:
        filler = disk / "filler"
        os.truncate(filler, filler.stat().st_size - leave)


def read_only(disk: Path) -> None:
    """Remount ``disk`` read-only: every write there fails with EROFS."""
    subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)


def leftovers(folder: Path) -> list[str]:
    """Temporary and half-written files under ``folder`` (the hidden ones tinylm writes before renaming)."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob(".*"))


def refused(capsys, argv: list[str], *expected: str) -> str:
    """The one line ``tinylm argv`` fails with, without its "tinylm: error: " prefix (`one_error_line`); each of
    ``expected`` must be part of it. Shared by every test of a refusal, not only the disk ones."""
    from tinylm.cli import main

    code = main(argv)
    line = one_error_line(code, capsys.readouterr().err)
    for part in expected:
        assert part in line, f"{part!r} not in {line!r}"
    return line


def one_error_line(code: int, err: str) -> str:
    """The error line of a command that ended with status ``code`` and printed ``err`` on stderr, without its
    "tinylm: error: " prefix: the status must be 2, and ``err`` that one line and no traceback."""
    lines = err.strip().splitlines()
    assert code == 2, f"exit status {code}, not 2:\n{err}"
    assert "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].startswith("tinylm: error: "), err
    return lines[0].removeprefix("tinylm: error: ")
