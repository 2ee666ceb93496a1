"""Benchmark: `tinylm eval`'s forward passes, tokens per second by batch size, on the tiny preset's model.

Run from the repository root::

    python benchmarks/eval_speed.py                  # the tiny preset, 40k tokens, 2 threads
    python benchmarks/eval_speed.py --preset small --tokens 20000 --threads 1

The model has the preset's shape and random weights (speed does not depend on the values) and
reads random tokens in disjoint windows of its block_size, as `tinylm eval` does, in batches of
256 to 8192 tokens; each setting is timed ``--repeats`` times, alternating, and the median is
printed with its ratio to the default (`tinylm.evaluate.EVAL_BATCH_TOKENS`). Every setting must give
the same loss (to float rounding).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from tinylm.config import resolve_config
from tinylm.evaluate import EVAL_BATCH_TOKENS, evaluate_tokens
from tinylm.model import GPT


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--tokens", type=int, default=40_000)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    config = resolve_config(preset=args.preset).model
    torch.manual_seed(0)
    model = GPT(config)
    data = np.random.default_rng(0).integers(0, config.vocab_size - 1, args.tokens).astype(np.int64)
    T = config.block_size
    sizes = sorted({max(1, n // T) for n in (256, 512, 1024, 2048, 4096, 8192)})
    times: dict[int, list[float]] = {b: [] for b in sizes}
    losses = {}
    for _ in range(args.repeats):
        for b in sizes:
            start = time.perf_counter()
            losses[b] = evaluate_tokens(model, data, 4 * args.tokens, config.vocab_size - 1, block_size=T,
                                        batch_size=b).loss
            times[b].append(time.perf_counter() - start)
    assert max(losses.values()) - min(losses.values()) < 1e-4, losses
    default = max(1, EVAL_BATCH_TOKENS // T)
    base = statistics.median(times[default])
    print(f"{args.preset}: {sum(p.numel() for p in model.parameters()):,} parameters, block_size {T}, "
          f"{args.threads} threads, {args.tokens:,} tokens, medians of {args.repeats}")
    for b in sizes:
        t = statistics.median(times[b])
        mark = "  <- default" if b == default else ""
        print(f"  batch {b:>4} ({b * T:>5} tokens): {args.tokens / t:>8,.0f} tokens/s, time x{t / base:.2f}{mark}")


if __name__ == "__main__":
    main()
