"""Benchmark: LoRA against full fine-tuning on the built-in tasks, exact match and wall time side by side.

Run from the repository root, with a trained default run (`tinylm train` makes runs/tiny-shakespeare)::

    python benchmarks/lora_tasks.py --run runs/tiny-shakespeare --tasks add count \\
        --variants full rank=8 rank=8,lr=3e-3 rank=16,targets=attention

Each variant is one `tinylm finetune` of the run on a task (the task's 20,000 training items, the
default budget unless ``steps=N``), then `tinylm eval --task` on its 200 held-out items: the exact
match of greedy replies. A variant is ``full`` (every weight) or comma-separated LoRA settings:
``rank``, ``alpha``, ``lr``, ``targets`` (attention, mlp, outer, all or W_q,..., joined by "+"), ``dropout``, ``bratio`` (B's
rate over A's, LoRA+), ``wd`` (weight decay), ``warmup``, ``decay`` (the schedule), and ``steps``.
``time=full`` gives a LoRA variant the steps that fit in the first full fine-tuning's training time on
that task (from the two runs' measured seconds per step), the comparison at equal time.

Every command runs with ``--threads`` and ``--device``; ``--parallel N`` runs N fine-tunings at
once (on a GPU machine with many cores; keep 1 where the timing matters). Each task's conversation
shards are made once and shared. This is a measurement, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

FLAGS = {"rank": "--lora-rank", "alpha": "--lora-alpha", "lr": "--lr", "targets": "--lora-targets",
         "dropout": "--lora-dropout", "steps": "--max-steps", "bratio": "--lora-b-lr-ratio", "wd": "--weight-decay",
         "warmup": "--warmup-steps", "decay": "--decay"}


def tinylm(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "tinylm", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"tinylm {' '.join(args)} failed:\n{done.stderr[-3000:]}")
    return done.stdout


def parse_variant(spec: str) -> dict[str, str]:
    if spec == "full":
        return {}
    settings = dict(part.split("=", 1) for part in spec.split(","))
    unknown = set(settings) - set(FLAGS) - {"time"}
    if unknown:
        raise SystemExit(f"unknown setting(s) {', '.join(sorted(unknown))} in {spec!r}; use {', '.join(FLAGS)}, time")
    return settings


def finetune(base: Path, task: str, work: Path, name: str, settings: dict[str, str], common: list[str]) -> dict:
    """One fine-tuning and its score: exact match, wall seconds, steps, seconds per step."""
    out = work / f"{task}-{name}"
    # targets=all+outer: "+" joins target names inside a variant, whose settings are comma-separated
    flags = [a for key, value in settings.items() if key in FLAGS for a in (FLAGS[key], value.replace("+", ","))]
    started = time.perf_counter()
    tinylm("finetune", "--from", str(base), "--data", f"tasks:{task}", "--out", str(out), "--data-dir",
           str(work / f"data-{task}"), "--no-progress", "--sample-tokens", "0", *flags, *common)
    seconds = time.perf_counter() - started
    score = json.loads(tinylm("eval", "--run", str(out), "--task", f"tasks:{task}", "--json", *common))["tasks"][0]
    info = json.loads((out / "run.json").read_text())
    return {"task": task, "variant": name, "exact_match": score["exact_match"], "seconds": seconds,
            "steps": info["step"], "ended": score.get("ended_with_end_of_turn"), "elapsed": info.get("elapsed")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--run", default="runs/tiny-shakespeare", help="the trained run to start from")
    parser.add_argument("--tasks", nargs="+", default=["add", "count"], help="built-in tasks (default: add count)")
    parser.add_argument("--variants", nargs="+", default=["full", "rank=8"], help="what to compare (module docstring)")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="CPU threads per command")
    parser.add_argument("--device", default="auto", help="cpu, cuda, auto")
    parser.add_argument("--parallel", type=int, default=1, help="fine-tunings at once (default 1)")
    parser.add_argument("--work", help="where the runs go (default: a temporary folder)")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    common = ["--threads", str(args.threads), "--device", args.device]
    base = Path(args.run)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        for task in args.tasks:  # the shards, once per task, before the runs that share them
            tinylm("finetune", "--from", str(base), "--data", f"tasks:{task}", "--out", str(work / f"prep-{task}"),
                   "--data-dir", str(work / f"data-{task}"), "--max-steps", "1", "--sample-tokens", "0",
                   "--no-progress", *common)
        variants = [(spec, parse_variant(spec)) for spec in args.variants]
        first = [(t, s, v) for t in args.tasks for s, v in variants if v.get("time") != "full"]
        with ThreadPoolExecutor(args.parallel) as pool:
            rows = list(pool.map(lambda tsv: finetune(base, tsv[0], work, tsv[1], tsv[2], common), first))
        timed = [(t, s, v) for t in args.tasks for s, v in variants if v.get("time") == "full"]
        for task, spec, settings in timed:  # equal wall time: the full run's seconds in this variant's steps
            full = next(r for r in rows if r["task"] == task and "rank" not in parse_variant(r["variant"]))
            probe = next((r for r in rows if r["task"] == task and r["variant"] == spec.replace(",time=full", "")), None)
            per_step = probe["elapsed"] / probe["steps"] if probe else full["elapsed"] / full["steps"]
            steps = max(1, round(full["elapsed"] / per_step))
            rows.append(finetune(base, task, work, spec.replace("=", "").replace(",", "-"),
                                 {**settings, "steps": str(steps)}, common) | {"variant": spec})
    print(f"fine-tuning {base} on built-in tasks: exact match of greedy replies to 200 held-out items")
    print(f"| task | variant | steps | training s | s/step | exact match | ended turn |")
    print(f"|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        ended = f"{100 * r['ended']:.1f}%" if r["ended"] is not None else "-"
        print(f"| {r['task']} | {r['variant']} | {r['steps']} | {r['elapsed']:.1f} | {r['elapsed'] / r['steps']:.3f} | "
              f"{100 * r['exact_match']:.1f}% | {ended} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
