"""The README's table of benchmark tasks: trained runs on every built-in task at several numbers of shots.

It trains nothing: give it run folders (any family) and it prints a Markdown table, one row per task and run,
one column per number of shots, each cell the accuracy (multiple choice: accuracy_norm in brackets; icl:copy:
exact match), with the task's chance level beside it. Run from the repository root::

    python benchmarks/tasks_table.py runs/tiny-shakespeare runs/ngram-shakespeare runs/lstm-shakespeare
    python benchmarks/tasks_table.py runs/tiny --tasks mc:cloze,icl:mapping --shots 0,1,2,4,8 --items 100

Every run reads the same items with the same shots (`tinylm.task_eval.evaluate_run_task`, seed 1234).
"""

from __future__ import annotations

import argparse
import sys
import time

from tinylm.compare import run_labels
from tinylm.data.mc_tasks import BUILTIN_TASKS
from tinylm.device import use_threads
from tinylm.run import load_run
from tinylm.task_eval import evaluate_run_task


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", metavar="RUN")
    parser.add_argument("--tasks", default=",".join(BUILTIN_TASKS))
    parser.add_argument("--shots", default="0,1,4")
    parser.add_argument("--items", type=int, default=200)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    shots = [int(s) for s in args.shots.split(",")]
    runs = [load_run(path) for path in args.runs]
    names = run_labels(args.runs)
    print(f"| task | chance | run | {' | '.join(f'{k}-shot' for k in shots)} |")
    print(f"|---|---:|---|{'---:|' * len(shots)}")
    with use_threads("cpu", args.threads):
        for task in args.tasks.split(","):
            for name, run in zip(names, runs):
                started = time.perf_counter()
                results = evaluate_run_task(run, task, shots=shots, items=args.items)
                cells = [f"{100 * r.accuracy:.1f}" + ("" if r.accuracy_norm is None else f" ({100 * r.accuracy_norm:.1f})")
                         for r in results]
                chance = results[0].chance
                print(f"| {task} | {100 * chance:.0f}% | {name} ({run.family}) | {' | '.join(cells)} |", flush=True)
                print(f"{task} on {name}: {time.perf_counter() - started:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
