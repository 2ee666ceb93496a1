"""Benchmark: the compiled one-token decoding step alone (the ahead-of-time package), by how many cache slots it reads
and by the C++ compiler's freedom to fuse multiply-adds and reorder sums.

Run from the repository root::

    python benchmarks/decode_step.py --run runs/tiny-shakespeare --threads 1
    python benchmarks/decode_step.py --run GPT2RUN --int8 --threads 1      # a run made by generate.py --make-gpt2-run

The decoder hands the package the mask of the slots written so far, so a step reads as many cached keys and
values as the sequence is long. The widths timed here (16 to 512 slots) show what that saves against reading
the whole cache, which every step did before (the widest row). The second column builds the same package
with inductor's `cpp.enable_unsafe_math_opt_flag` and `cpp.enable_floating_point_contract_flag="fast"` added to
`tinylm.generate.fast.ONE_TOKEN_INDUCTOR_OPTIONS` (the C++ compiler free to fuse multiply-adds and reorder sums),
which tinylm does not use: the whole step measured no faster with them. Each cell is the median of ``--repeats`` rounds of 20 calls,
the variants taking turns in one process.

This is a measurement, not a test.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tinylm.generate import aot
from tinylm.generate.fast import ONE_TOKEN_INDUCTOR_OPTIONS, StaticDecoder
from tinylm.run import load_run

FLAGS = {"cpp.enable_unsafe_math_opt_flag": True, "cpp.enable_floating_point_contract_flag": "fast"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", required=True, metavar="DIR")
    parser.add_argument("--int8", action="store_true", help="quantize the model's matrices to int8 first")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--widths", default="16,128,256,512", help="cache slots read, comma-separated")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    run = load_run(args.run, device="cpu")
    if args.int8:
        from tinylm.model.quant import quantize_int8

        quantize_int8(run.model)
    cfg = run.model.config
    decoder = StaticDecoder(run.model, 1, cfg.block_size, compile=True, extra=8)
    widths = [int(w) for w in args.widths.split(",")]
    with torch.inference_mode():
        decoder.start(torch.randint(0, cfg.vocab_size, (1, max(widths))), torch.ones(1, max(widths), dtype=torch.bool))
        decoder.truncate(0)  # the slots keep their keys and values; each width below reads the first ones
        one = (torch.tensor([[1]]), torch.tensor([1]), torch.tensor([[1]]), decoder.mask[:, :2], decoder.k, decoder.v)
        steps = {name: aot.one_token_step(decoder.compiled_weights, one, options)
                 for name, options in (("as tinylm builds it", ONE_TOKEN_INDUCTOR_OPTIONS),
                                       ("with the compiler flags", {**ONE_TOKEN_INDUCTOR_OPTIONS, **FLAGS}))}
        ms: dict[tuple[str, int], list[float]] = {(name, w): [] for name in steps for w in widths}
        for _ in range(args.repeats):
            for w in widths:
                inputs = (torch.tensor([[1]]), torch.tensor([w - 1]), torch.tensor([[w - 1]]), decoder.mask[:, :w],
                          decoder.k, decoder.v)
                for name, step in steps.items():
                    started = time.perf_counter()
                    for _ in range(20):
                        step(*inputs)
                    ms[(name, w)].append((time.perf_counter() - started) / 20 * 1e3)
    print(f"{args.run}{' int8' if args.int8 else ''}: {cfg.n_layer} layers, d = {cfg.d_model}, {cfg.block_size + 8} "
          f"cache slots; {args.threads} thread(s); ms a step, median of {args.repeats}")
    print()
    print("| slots read | " + " | ".join(steps) + " |")
    print("|---:|" + "---:|" * len(steps))
    for w in widths:
        print(f"| {w} | " + " | ".join(f"{statistics.median(ms[(name, w)]):.3f}" for name in steps) + " |")


if __name__ == "__main__":
    main()
