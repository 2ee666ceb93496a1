"""The README's tour, run as written, so it cannot drift from the code again.

Every command of the ```bash block under "## A tour" runs in order, in an empty folder holding a
copy of `examples/` (as a fresh clone's root does), each on the outputs of the lines before it:
nothing is written into the repository. The commands are the README's own, with the training
budgets cut to a few steps by one rewrite rule (`shrink`), so the whole tour takes about a minute
instead of days. A comment ``# prints X`` on a line is checked: the command must print exactly X.
`tinylm serve` never ends by itself, so it is started for real (on a free port, not 8000), asked
for /health, and stopped: more than `--help` would show, and it costs a few seconds.
"""

from __future__ import annotations

import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tinylm.cli import main

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

# The rewrite rule: the flags each kind of command gets, replacing the line's own value of that flag
# where it has one, and added where it has none.
NETWORK_BUDGET = {  # `tinylm train` of a network (gpt, lstm, rnn), also under torchrun
    "--max-steps": "2",
    "--batch-size": "2",              # the small preset's 32 x 4 x 512 tokens a step would take a minute
    "--grad-accum": "1",
    "--tokenizer-vocab-size": "300",  # every run then shares one small tokenizer per corpus
    "--eval-tokens": "256",
    "--final-eval-tokens": "256",     # not the whole validation split
    "--sample-tokens": "8",
    "--threads": "1",                 # the test machine's other tests share its cores
}
COUNTING_BUDGET = {"--tokenizer-vocab-size": "300", "--sample-tokens": "8"}  # `tinylm train --model ngram`
BUDGETS = {
    "prepare": {"--vocab-size": "300"},   # only where the line trains a tokenizer (has --vocab-size)
    "eval": {"--tokens": "512", "--items": "5"},   # --items: a --task line asks five items per task
    "finetune": {"--max-steps": "2", "--batch-size": "2", "--sample-tokens": "8", "--threads": "1"},
    "compare": {"--tokens": "512"},
    "sample": {"--max-new-tokens": "16"},
}


def tour() -> list[tuple[list[str], str]]:
    """(argv, the comment after it) for every command of the tour's bash block, in order."""
    text = README.read_text(encoding="utf-8")
    section = text.split("\n## A tour\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, flags=re.S).group(1)
    commands = []
    for line in block.splitlines():
        argv = shlex.split(line, comments=True)
        if argv:
            comment = line.split(" # ", 1)[1].strip() if " # " in line else ""
            commands.append((argv, comment))
    return commands


def _with(argv: list[str], flags: dict[str, str]) -> list[str]:
    argv = list(argv)
    for flag, value in flags.items():
        if flag in argv:
            argv[argv.index(flag) + 1] = value
        else:
            argv += [flag, value]
    return argv


def shrink(argv: list[str]) -> list[str]:
    """The README's command with small budgets (see the flag tables above).

    A `--resume` line runs as written: resuming takes the run's saved settings, and changing them
    would be another command. The tokenizer lines run as written too (2 s at |V| 4096), so the ids
    the tour shows are the ones this tokenizer gives.
    """
    tinylm = argv.index("tinylm")  # argv[0], or after `torchrun ... -m`
    command = argv[tinylm + 1]
    if command == "train":
        if "--resume" in argv:
            return argv
        return _with(argv, COUNTING_BUDGET if "ngram" in argv else NETWORK_BUDGET)
    if command == "prepare" and "--vocab-size" not in argv:
        return argv
    return _with(argv, BUDGETS.get(command, {}))


def test_the_tour_is_one_command_a_line():
    """The rewrite rule needs plain commands: no pipes, redirections or shell variables."""
    commands = tour()
    assert len(commands) >= 30
    for argv, _ in commands:
        assert argv[0] in ("tinylm", "torchrun"), argv
        assert not {"|", ">", "<", "&&", ";"} & set(argv) and not any("$" in a for a in argv), argv


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(argv: list[str], cwd: Path) -> None:
    """Start `tinylm serve` as the README does (on a free port, not 8000), check /health, stop it."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tinylm", *_with(argv[1:], {"--port": str(port)})], cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, f"tinylm serve exited early: {proc.stdout.read()}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as response:
                    assert response.status == 200
                    return
            except (urllib.error.URLError, ConnectionError, TimeoutError):  # a loaded machine: slow, not down
                assert time.monotonic() < deadline, "tinylm serve did not answer /health within 120 s"
                time.sleep(0.3)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.slow
def test_the_readme_tour_runs_as_written(tmp_path, monkeypatch, capsys, shakespeare_corpus):
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    monkeypatch.chdir(tmp_path)
    for argv, comment in tour():
        shown = shlex.join(argv)
        if argv[:2] == ["tinylm", "serve"]:
            _serve(argv, tmp_path)
            continue
        argv = shrink(argv)
        if argv[0] == "torchrun":  # torchrun is torch.distributed.run: start it from this Python
            proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", *argv[1:]], cwd=tmp_path,
                                  capture_output=True, text=True, timeout=300)
            assert proc.returncode == 0, f"{shown}\n{proc.stdout}{proc.stderr}"
            continue
        # in this process, through the console script's own entry point: one torch import, not forty
        code = main(argv[1:])
        out, err = capsys.readouterr()
        assert code == 0, f"{shlex.join(argv)} exited with {code}:\n{out}{err}"
        if comment.startswith("prints "):
            assert out.strip() == comment.removeprefix("prints "), shown


def test_the_latin1_example_is_latin1():
    """An editor that saved examples/old-latin1/ as UTF-8 would leave the tour's --encoding line nothing to show."""
    for path in sorted((ROOT / "examples" / "old-latin1").glob("*.txt")):
        data = path.read_bytes()
        assert "é".encode("latin-1") in data, path
        with pytest.raises(UnicodeDecodeError):
            data.decode("utf-8")


@pytest.mark.slow
def test_the_readme_python_block_runs(tmp_path, monkeypatch, shakespeare_corpus):
    """The "From Python" block, run as written but for its budgets: the same lines, with a smaller
    vocabulary and a two-step run (the rewrites are the two replacements below, nothing else)."""
    text = README.read_text(encoding="utf-8")
    block = re.search(r"From Python:\n\n```python\n(.*?)```", text, re.S).group(1)
    small = block.replace("vocab_size=4096", "vocab_size=300").replace(
        '{"max_steps": 300}',
        '{"max_steps": 2, "tokenizer_vocab_size": 300, "eval_interval": 1, "final_eval_tokens": 256, "sample_tokens": 8}')
    assert "vocab_size=4096" in block and '{"max_steps": 300}' in block  # what the rewrites expect the README to say
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(small, "README.md (From Python)", "exec"), namespace)
    assert namespace["result"].val["bits_per_byte"] > 0
    assert namespace["run"].tokenizer.vocab_size == 300 and (tmp_path / "runs" / "py" / "run.json").is_file()
