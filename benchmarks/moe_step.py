"""Benchmark: a training step of the default model with its dense MLP against a Mixture of Experts at equal active size.

Run from the repository root::

    python benchmarks/moe_step.py                    # tiny preset, 8 experts, top 2, 2 threads
    python benchmarks/moe_step.py --experts 16 --top-k 4 --dtype float32 --repeats 9

One training step (forward, backward, the optimizer; Muon for the matrices, AdamW for the rest and
for the router, as `tinylm train` does) of the tiny preset's model on one batch of the default
run's short steps, 32 x 128 tokens, under `tinylm train`'s precision on a CPU (bfloat16 autocast,
the head and the loss a slice of positions at a time), timed four ways that alternate within each
of ``--repeats`` rounds (so a busy neighbour slows them alike):

1. **dense**: the preset's SwiGLU MLP, hidden width d_ff;
2. **MoE reference**: E experts of width d_ff / k (the same active parameters and FLOPs per
   token, plus the router's d E), the loop over the experts (``moe_dispatch = "reference"``);
3. **MoE fast, grouped_mm**: the tokens sorted by expert, each matrix one ``F.grouped_mm`` call
   (``moe_dispatch = "fast"`` with ``grouped = "grouped_mm"``);
4. **MoE fast, split**: the same sort, a product per expert's run of rows (what `tinylm train`
   runs: it measured faster than grouped_mm over a whole step).

Each MoE step includes the balancing losses and, after the optimizer, the counting the training
loop does. Medians are printed with each one's ratio to the dense step; the machine may be shared,
so read the ratios.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from tinylm.config import resolve_config
from tinylm.device import autocast_for, precision_name
from tinylm.model import GPT
from tinylm.train.distributed import Distributed
from tinylm.train.moe import MoETraining, moe_layers
from tinylm.train.optim import make_optimizer


def build(config, train, dispatch: str | None, grouped: str = "auto"):
    """A model of ``config`` (dense when ``dispatch`` is None), its optimizer under ``train`` and its MoE bookkeeping."""
    torch.manual_seed(0)
    model = GPT(config)
    for _, layer in moe_layers(model):
        layer.dispatch, layer.grouped = dispatch, grouped
    return model, make_optimizer(model, train, fused=True), MoETraining(model, config, Distributed())


def step(model, optimizer, moe: MoETraining, x: torch.Tensor, y: torch.Tensor, autocast) -> None:
    with autocast():
        _, nll = model(x, targets=y, reduction="sum", return_logits=False)
    loss = nll / y.numel()
    balance = moe.penalty(1)
    (loss if balance is None else loss + balance).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    moe.after_step()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = resolve_config()  # what `tinylm train` runs with no arguments
    dense = dataclasses.replace(config.model, block_size=args.context)
    moe = dataclasses.replace(dense, moe_experts=args.experts, moe_top_k=args.top_k)
    autocast = autocast_for(torch.device("cpu"), args.dtype)
    train = config.train
    ways = {"dense": build(dense, train, None),
            "MoE reference": build(moe, train, "reference"),
            "MoE fast, grouped_mm": build(moe, train, "fast", "grouped_mm"),
            "MoE fast, split": build(moe, train, "fast", "split")}
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, dense.vocab_size, (args.batch, args.context), generator=g)
    y = torch.randint(0, dense.vocab_size, (args.batch, args.context), generator=g)
    times: dict[str, list[float]] = {name: [] for name in ways}
    for name, way in ways.items():  # warm up each
        step(*way, x, y, autocast)
    for _ in range(args.repeats):
        for name, way in ways.items():
            start = time.perf_counter()
            step(*way, x, y, autocast)
            times[name].append(time.perf_counter() - start)
    print(f"tiny preset (d_model {dense.d_model}, {dense.n_layer} layers, {dense.mlp} d_ff {dense.hidden_dim}), "
          f"{args.batch} x {args.context} tokens a step, {torch.get_num_threads()} threads, "
          f"{precision_name(torch.device('cpu'), args.dtype)}; MoE: "
          f"{moe.moe_experts} experts of width {moe.moe_hidden_dim}, top {moe.moe_top_k}")
    base = statistics.median(times["dense"])
    print(f"{'step':<24}{'median ms':>12}{'x dense':>10}")
    for name, ts in times.items():
        median = statistics.median(ts)
        print(f"{name:<24}{median * 1e3:>12.1f}{median / base:>10.2f}")


if __name__ == "__main__":
    main()
