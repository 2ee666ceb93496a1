"""The `tinylm explain` group: every subcommand is registered, and the bare group prints its help."""

from __future__ import annotations

import subprocess
import sys


def test_the_group_lists_its_commands_and_exits_2_without_one():
    out = subprocess.run([sys.executable, "-m", "tinylm", "explain"], capture_output=True, text=True)
    assert out.returncode == 2
    for command in ("tokens", "sampling", "cost", "attention", "forward"):
        assert f"    {command}" in out.stderr
    top = subprocess.run([sys.executable, "-m", "tinylm", "--help"], capture_output=True, text=True)
    assert "    explain" in top.stdout
