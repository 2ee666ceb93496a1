"""Benchmark: `tinylm eval` and `tinylm sample` on an idle machine and beside a busy neighbour, at the thread count
each command chooses.

Run from the repository root, on an otherwise idle machine, with a trained run::

    python benchmarks/command_threads.py --run runs/quick
    python benchmarks/command_threads.py --run runs/quick --tokens 65536 --new-tokens 120 --repeats 3

Every command that runs a model picks its CPU threads by `tinylm.device.use_threads`: one per core
that is idle when it starts, the busy ones left out. This times each command as a user runs it (a
fresh `python -m tinylm` process, start-up included), first alone, then beside ``--neighbours``
processes that each keep one core busy (a Python busy loop, like another training run or a test
suite), and last alone again with ``--threads`` set to the count it should choose beside them. It
prints the medians, the thread line each command said, and the ratio of the busy time to the idle
time at the chosen count: the rule's aim is that a busy neighbour costs a command little more than
the cores it takes (and the ratio to the idle time with every core, for comparison).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time


def timed(argv: list[str]) -> tuple[float, str]:
    """Seconds one command took, and the thread line it said on stderr."""
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "tinylm", *argv], capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed: {proc.stderr.strip()}")
    said = [line for line in proc.stderr.splitlines() if line.startswith("tinylm: threads:")]
    return seconds, said[0].removeprefix("tinylm: ") if said else "(no thread line)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", default="runs/quick", help="a trained run folder (default: runs/quick)")
    parser.add_argument("--tokens", type=int, default=65536, help="tokens `tinylm eval --tokens` scores")
    parser.add_argument("--new-tokens", type=int, default=120, help="tokens `tinylm sample` writes")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--neighbours", type=int, default=1)
    args = parser.parse_args()

    commands = {
        "eval": ["eval", "--run", args.run, "--tokens", str(args.tokens)],
        "sample": ["sample", "--run", args.run, "--prompt", "ROMEO:", "--max-new-tokens", str(args.new_tokens),
                   "--temperature", "0", "--stop", "\\n\\n\\n"],
    }
    # the thread count a command should choose beside the neighbours: one per core they leave free
    free = max(1, len(os.sched_getaffinity(0)) - args.neighbours)
    conditions = {"idle": (0, []), "busy": (args.neighbours, []),
                  "idle at the chosen count": (0, ["--threads", str(free)])}
    times: dict[tuple[str, str], list[float]] = {}
    lines: dict[tuple[str, str], str] = {}
    for condition, (neighbours, extra) in conditions.items():
        spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(neighbours)]
        try:
            time.sleep(0.5 if neighbours else 0)  # the neighbours are running before a command looks
            for _ in range(args.repeats):
                for name, argv in commands.items():
                    seconds, line = timed(argv + extra)
                    times.setdefault((name, condition), []).append(seconds)
                    lines[(name, condition)] = line if not extra else f"--threads {free}"
        finally:
            for p in spinners:
                p.kill()
                p.wait()
    print(f"{args.run}: eval --tokens {args.tokens}, sample --max-new-tokens {args.new_tokens}; medians of "
          f"{args.repeats} runs, whole commands (start-up included)")
    for name in commands:
        median = {condition: statistics.median(times[(name, condition)]) for condition in conditions}
        for condition in conditions:
            where = f"beside {args.neighbours} busy neighbour(s)" if condition == "busy" else condition
            print(f"  {name}: {where} {median[condition]:.2f} s ({lines[(name, condition)]})")
        print(f"  {name}: busy / idle at the chosen count = x{median['busy'] / median['idle at the chosen count']:.2f}"
              f"; busy / idle = x{median['busy'] / median['idle']:.2f}")

if __name__ == "__main__":
    main()
