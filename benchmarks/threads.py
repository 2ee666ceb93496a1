"""Benchmark: is a training step of the default model faster on one thread or on all, beside a busy neighbour?

Run from the repository root, on an otherwise idle machine::

    python benchmarks/threads.py                     # the tiny preset, batch 32 x 128, bf16 autocast where native
    python benchmarks/threads.py --neighbours 2 --steps 5

`tinylm train` picks its thread count from the cores that are idle when it starts (a core busy
with another process is left out: `tinylm.device.default_cpu_threads`). This measures the
rule's premise: seconds per training step (forward, backward, AdamW) of the preset's model at 1
thread and at every core, first alone, then beside ``--neighbours`` processes that each keep one
core busy (a Python busy loop, like another training run or a test suite). Settings alternate
within each of ``--repeats`` rounds; medians are printed, with the ratio of all-cores to one.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch

from tinylm.config import resolve_config
from tinylm.model import GPT
from tinylm.device import native_bf16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--neighbours", type=int, default=1)
    args = parser.parse_args()

    config = resolve_config(preset=args.preset)
    torch.manual_seed(0)
    model = GPT(config.model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    B, T, V = config.train.batch_size, config.model.block_size, config.model.vocab_size
    x, y = torch.randint(0, V, (B, T)), torch.randint(0, V, (B, T))
    bf16 = native_bf16(torch.device("cpu"))
    cores = len(os.sched_getaffinity(0))

    def seconds_per_step(threads: int) -> float:
        torch.set_num_threads(threads)
        start = time.perf_counter()
        for _ in range(args.steps):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                _, loss = model(x, y)[:2]
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return (time.perf_counter() - start) / args.steps

    seconds_per_step(cores)  # warm-up
    print(f"{args.preset}: batch {B} x {T}, {'bf16 autocast' if bf16 else 'float32'}, {cores} cores, "
          f"medians of {args.repeats} rounds of {args.steps} steps")
    for neighbours in (0, args.neighbours):
        spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(neighbours)]
        try:
            times: dict[int, list[float]] = {1: [], cores: []}
            for _ in range(args.repeats):
                for threads in times:
                    times[threads].append(seconds_per_step(threads))
        finally:
            for p in spinners:
                p.kill()
        one, all_ = statistics.median(times[1]), statistics.median(times[cores])
        print(f"  {neighbours} busy neighbour(s): 1 thread {one:.3f} s/step, {cores} threads {all_:.3f} s/step, "
              f"{cores} threads take x{all_ / one:.2f} the time of 1")


if __name__ == "__main__":
    main()
