"""Benchmark: fine-tuning the default run on built-in tasks, before and after, and its speed beside pretraining's.

Run from the repository root, with a trained default run (`tinylm train` makes runs/tiny-shakespeare)::

    python benchmarks/finetune.py --run runs/tiny-shakespeare --tasks add count

For each task: the run's exact match on 200 held-out items before (`tinylm eval --task`: a base
model reads the chat's markers as plain text), then `tinylm finetune` with its default recipe (two
epochs of the task's 20,000 training items) and its wall time, then the exact match after and the
share of replies that ended with the end-of-turn token.

Speed, two ways, fine-tuning on the first task against pretraining the same model on its own corpus:

- the real commands: training tokens per second (the median of the logged steps, padding not
  counted) of `tinylm finetune` against `tinylm train --init-from` the run at its own batch size,
  each for ``--speed-steps`` steps, in turns ``--repeats`` times;
- one process (`step_speeds`): the training step of each, packed conversations and packed text,
  ``--speed-steps`` of one then of the other, in turns ``--repeats`` times: the machine's load
  hits both alike even when it changes from one second to the next.

Every command runs with ``--threads`` (default: all cores), as a user on a quiet machine runs it.

This is a measurement, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from tinylm.train import prepare_data
from tinylm.run import load_run


def tinylm(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "tinylm", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"tinylm {' '.join(args)} failed:\n{done.stderr[-2000:]}")
    return done.stdout


def task_score(run: Path, task: str, threads: list[str]) -> dict:
    return json.loads(tinylm("eval", "--run", str(run), "--task", f"tasks:{task}", "--json", *threads))["tasks"][0]


def median_speed(run: Path) -> float:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    speeds = [r["tokens_per_s"] for r in rows if r.get("kind") == "train"]
    return statistics.median(speeds[1:] or speeds)  # the first line includes the first step's warm-up


def step_speeds(base: Path, chat_shards: Path, text_shards: Path, rounds: int, steps: int) -> tuple[list, list]:
    """Training tokens/s of fine-tuning's packed conversation steps and pretraining's packed text steps on the
    same model, in one process: ``steps`` steps of each in turn, ``rounds`` times, so that the machine's load
    hits both alike. Each step is the training loop's: bfloat16 autocast, the head in slices, the optimizer."""
    import dataclasses

    from tinylm.data.shards import ShardSet
    from tinylm.model import build_model
    from tinylm.train import BatchSource, make_optimizer

    config = load_run(base).config
    chats, text = ShardSet.open(chat_shards), ShardSet.open(text_shards)
    model = build_model(dataclasses.replace(config.model, vocab_size=chats.vocab_size)).train()
    optimizer = make_optimizer(model, config.train)
    common = {"batch_size": config.train.batch_size, "block_size": config.model.block_size, "seed": 0,
              "bos_id": 0, "pad_id": 0}
    sources = {"fine-tuning": BatchSource(chats, mode="chats", **common),
               "pretraining": BatchSource(text, mode="packed", **common)}
    speeds: dict[str, list[float]] = {kind: [] for kind in sources}
    for r in range(rounds):
        for kind in (list(sources) if r % 2 == 0 else list(sources)[::-1]):
            for step in range(r * steps, (r + 1) * steps):
                batch = sources[kind].step_batch(step)
                started = time.perf_counter()
                inputs = batch.to(torch.device("cpu"))
                targets = inputs.pop("targets")
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    _, nll = model(**inputs, targets=targets, reduction="sum", return_logits=False)
                (nll / batch.n_targets).backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                if r > 0 or step > 2:  # the first steps warm up the kernels
                    speeds[kind].append(batch.n_inputs / (time.perf_counter() - started))
    return speeds["fine-tuning"], speeds["pretraining"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--run", default="runs/tiny-shakespeare", help="the trained run to start from")
    parser.add_argument("--tasks", nargs="+", default=["add", "count"], help="built-in tasks (default: add count)")
    parser.add_argument("--speed-steps", type=int, default=60, help="steps of each speed run (default: 60)")
    parser.add_argument("--repeats", type=int, default=3, help="speed runs of each kind, in turns (default: 3)")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="CPU threads (default: all cores)")
    args = parser.parse_args()
    threads = ["--threads", str(args.threads)]
    base = Path(args.run)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        rows = []
        for task in args.tasks:
            before = task_score(base, task, threads)
            out = work / f"chat-{task}"
            started = time.perf_counter()
            tinylm("finetune", "--from", str(base), "--data", f"tasks:{task}", "--out", str(out),
                   "--data-dir", str(work / f"data-{task}"), "--no-progress", *threads)
            minutes = (time.perf_counter() - started) / 60
            after = task_score(out, task, threads)
            rows.append((task, before, after, minutes))
        speeds: dict[str, list[float]] = {"fine-tuning": [], "pretraining": []}
        batch_size = str(load_run(base).config.train.batch_size)  # the preset's may differ from the run's
        for i in range(args.repeats):
            for kind in (["fine-tuning", "pretraining"] if i % 2 == 0 else ["pretraining", "fine-tuning"]):
                out = work / f"speed-{kind}-{i}"
                common = ["--out", str(out), "--max-steps", str(args.speed_steps), "--eval-interval", "100000",
                          "--sample-tokens", "0", "--log-interval", "5", "--no-progress", *threads]
                if kind == "fine-tuning":
                    tinylm("finetune", "--from", str(base), "--data", f"tasks:{args.tasks[0]}",
                           "--data-dir", str(work / f"data-{args.tasks[0]}"), *common)
                else:
                    tinylm("train", "--init-from", str(base), "--batch-size", batch_size, "--final-eval-tokens", "0",
                           *common)
                speeds[kind].append(median_speed(out))
        torch.set_num_threads(args.threads)
        run = load_run(base)
        text = prepare_data(run.config.train, run.tokenizer, log=lambda line: None).path
        in_process = step_speeds(base, work / f"data-{args.tasks[0]}", text, args.repeats, args.speed_steps)
    print(f"fine-tuning {base} on built-in tasks, default recipe (two epochs), greedy replies to 200 held-out items")
    print(f"{'task':<10} {'before':>8} {'after':>8} {'ended turn':>11} {'minutes':>8}")
    for task, before, after, minutes in rows:
        print(f"{task:<10} {100 * before['exact_match']:>7.1f}% {100 * after['exact_match']:>7.1f}% "
              f"{100 * after['ended_with_end_of_turn']:>10.1f}% {minutes:>8.1f}")
    ft, pre = statistics.median(speeds["fine-tuning"]), statistics.median(speeds["pretraining"])
    print(f"\ntraining tokens/s (median of {args.repeats} runs of {args.speed_steps} steps, in turns): "
          f"fine-tuning {ft:,.0f}, pretraining {pre:,.0f}: {ft / pre:.2f}x")
    ft, pre = (statistics.median(s) for s in in_process)
    print(f"training tokens/s in one process (median step, {args.repeats} x {args.speed_steps} steps of each in turns): "
          f"fine-tuning {ft:,.0f}, pretraining {pre:,.0f}: {ft / pre:.2f}x")


if __name__ == "__main__":
    main()
