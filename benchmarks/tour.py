"""Benchmark: the README tour, top to bottom, each line timed beside busy neighbours.

Run from the root of a fresh clone (the tour writes data/ and runs/ there, as a user's would)::

    python benchmarks/tour.py                     # every line, one busy neighbour
    python benchmarks/tour.py --neighbours 0      # on an idle machine
    python benchmarks/tour.py --match explain     # only the lines that contain "explain"

What is measured: each command of the README's tour block, run as written through ``bash -c``
with ``--neighbours`` processes spinning on the CPU beside it (a shared machine), its wall time and
exit status. `tinylm serve` is timed from its start to the answer of a first completion, then
stopped with Ctrl-C. The yardstick is the tour's own default run (`tinylm train`): the last column
is each line's time over it. A line that says it is long (its comment says "days") runs with
``--max-steps 2`` and is marked.
A line that needs the outputs of the lines before it must run after them: use --match only for
lines whose inputs are already there.

This is a measurement, not a test.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def tour_lines(readme: Path) -> list[tuple[str, str]]:
    """(command, comment) for every command line of the README's tour block, in order."""
    text = readme.read_text(encoding="utf-8")
    block = re.search(r"## A tour.*?```bash\n(.*?)```", text, re.S).group(1)
    lines = []
    for line in block.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        command, _, comment = line.partition("  #")
        lines.append((command.strip(), comment.strip()))
    return lines


def time_serve(command: str) -> tuple[float, int]:
    port = re.search(r"--port (\d+)", command).group(1)
    start = time.perf_counter()
    server = subprocess.Popen(shlex.split(command), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    body = json.dumps({"prompt": "ROMEO.", "max_tokens": 40}).encode()
    try:
        while server.poll() is None:
            try:
                request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                                 {"content-type": "application/json"})
                urllib.request.urlopen(request, timeout=120).read()
                return time.perf_counter() - start, 0
            except OSError:
                time.sleep(0.1)
        return time.perf_counter() - start, server.returncode
    finally:
        server.send_signal(signal.SIGINT)
        server.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--neighbours", type=int, default=1, help="busy processes beside the tour (default: 1)")
    parser.add_argument("--match", help="only the lines that contain this text")
    args = parser.parse_args()
    lines = [(c, note) for c, note in tour_lines(ROOT / "README.md") if not args.match or args.match in c]
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.neighbours)]
    rows = []
    try:
        for command, note in lines:
            long = "days" in note
            if long:  # the small preset's line: a few steps show it starts; its length is the README's estimate
                command += " --max-steps 2"
            if command.startswith("tinylm serve"):
                seconds, status = time_serve(command)
            else:
                start = time.perf_counter()
                status = subprocess.run(command, shell=True, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL).returncode
                seconds = time.perf_counter() - start
            rows.append((command, seconds, status, long))
            print(f"{seconds:9.1f} s  exit {status}  {command}", flush=True)
    finally:
        for spinner in spinners:
            spinner.kill()
    yardstick = next((s for c, s, _, _ in rows if c == "tinylm train"), None)
    print(f"\nbeside {args.neighbours} busy neighbour(s); the yardstick is the default run (tinylm train): "
          f"{'not run' if yardstick is None else f'{yardstick:.1f} s'}")
    for command, seconds, status, long in rows:
        ratio = f"{seconds / yardstick:5.2f}x" if yardstick else "  -  "
        print(f"{ratio}  {seconds:8.1f} s  exit {status}{'  (says it is long)' if long else ''}  {command}")


if __name__ == "__main__":
    main()
