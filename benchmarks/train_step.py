"""Benchmark: where a bfloat16 training step of the default model goes on a CPU, and what the two fast paths buy.

Run from the repository root, on an otherwise idle machine::

    python benchmarks/train_step.py                  # the tiny preset, 32 x 128 tokens, every core
    python benchmarks/train_step.py --threads 1 --repeats 9

A training step (forward, backward, the optimizer) of the preset's model under bfloat16 autocast,
timed three ways that alternate within each of ``--repeats`` rounds:

1. **plain**: ``lm_head`` gives the (B, T, |V|) logits, then ``F.cross_entropy`` on them in float32,
   and attention's backward pass through PyTorch's fused kernel (the head and attention as training
   ran them before; RoPE rotates in bfloat16 in all three);
2. **sliced head**: the head and the loss a slice of positions at a time (`tinylm.model.head_loss`);
3. **+ attention backward written out**: as 2, with the causal attention's gradient written out
   (`tinylm.model.attention._CausalAttention`: scores and softmax in float32, the products with the
   gradient in bfloat16) instead of the fused kernel's backward.

``--attention`` times causal attention alone instead (forward, forward + backward) through the fused
kernel and through the written-out backward, at the three contexts that set
`WRITTEN_OUT_BACKWARD_MAX_T`: T = 128, 256 and 512 at 4096 tokens a batch, 6 heads of 32.

`tinylm train` uses 3 whenever it trains a Transformer under bfloat16 autocast on a CPU with a
context of at most `WRITTEN_OUT_BACKWARD_MAX_T` (128) tokens. Medians are
printed with each path's ratio to the plain one; the machine is shared, so read the ratios.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import tinylm.model.attention as attention
from tinylm.config import resolve_config
from tinylm.model import GPT
from tinylm.train.optim import make_optimizer

PATHS = ("plain", "sliced head", "+ attention backward written out")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: every core)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--attention", action="store_true", help="time causal attention alone, fused vs written out")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.attention:
        attention_table(args.repeats)
        return

    config = resolve_config(preset=args.preset)
    config.model.vocab_size = args.vocab_size
    B, T = config.train.batch_size, config.model.block_size
    torch.manual_seed(0)
    model = GPT(config.model)
    optimizer = make_optimizer(model, config.train, fused=True)
    x, y = torch.randint(0, args.vocab_size, (B, T)), torch.randint(0, args.vocab_size, (B, T))
    written_out = attention.WRITTEN_OUT_BACKWARD_MAX_T

    def step(path: int) -> float:
        attention.WRITTEN_OUT_BACKWARD_MAX_T = written_out if path == 2 else 0
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if path == 0:
                logits, _ = model(x)
            else:
                _, loss = model(x, y, reduction="sum", return_logits=False)
        if path == 0:
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum")
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    for path in range(len(PATHS)):  # warm up every path once
        step(path)
    times: list[list[float]] = [[] for _ in PATHS]
    for _ in range(args.repeats):
        for path in range(len(PATHS)):
            times[path].append(step(path))
    attention.WRITTEN_OUT_BACKWARD_MAX_T = written_out
    medians = [statistics.median(t) for t in times]
    print(f"{args.preset}, {B} x {T} tokens a step, |V| {args.vocab_size}, {torch.get_num_threads()} thread(s), "
          f"bfloat16 autocast, medians of {args.repeats}")
    print("| path | s per step | tokens/s | time vs plain |")
    print("|---|---|---|---|")
    for name, median in zip(PATHS, medians):
        print(f"| {name} | {median:.3f} | {B * T / median:,.0f} | {median / medians[0]:.2f}x |")


def attention_table(repeats: int) -> None:
    written_out = attention.WRITTEN_OUT_BACKWARD_MAX_T
    print(f"causal attention, bfloat16, {torch.get_num_threads()} thread(s), medians of {repeats}, ms")
    print("| T | batch | fused forward | fused forward + backward | written-out forward + backward |")
    print("|---|---|---|---|---|")
    for T in (128, 256, 512):
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(4096 // T, 6, T, 32, generator=g).bfloat16().requires_grad_() for _ in range(3))
        dy = torch.randn(4096 // T, 6, T, 32, generator=g).bfloat16()

        def run(limit: int, backward: bool) -> float:
            attention.WRITTEN_OUT_BACKWARD_MAX_T = limit
            start = time.perf_counter()
            if backward:
                attention.sdpa_attention(q, k, v).backward(dy)
            else:
                with torch.no_grad():
                    attention.sdpa_attention(q, k, v)
            return time.perf_counter() - start

        cases = ((0, False), (0, True), (T, True))
        times: list[list[float]] = [[] for _ in cases]
        for round_ in range(repeats + 1):  # the cases alternate; round 0 warms up
            for case, kept in zip(cases, times):
                q.grad = k.grad = v.grad = None
                took = run(*case)
                if round_:
                    kept.append(took)
        print(f"| {T} | {4096 // T} | " + " | ".join(f"{statistics.median(t) * 1000:.1f}" for t in times) + " |")
    attention.WRITTEN_OUT_BACKWARD_MAX_T = written_out


if __name__ == "__main__":
    main()
