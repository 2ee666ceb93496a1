"""Benchmark: a training step of tinylm's GPT next to Hugging Face `transformers`' GPT2LMHeadModel, on the CPU.

Run from the repository root::

    python benchmarks/train.py                      # both shapes, float32, eager: 2-3 minutes
    python benchmarks/train.py --threads 2 --repeats 11
    python benchmarks/train.py --compile            # torch.compile both models (adds ~3 minutes, cold)
    python benchmarks/train.py --bf16               # both under bfloat16 autocast
    python benchmarks/train.py --shapes baby --steps 20

What is measured: training tokens/s, a step being forward + loss + backward + ``AdamW.step()`` +
``zero_grad()``, for

- tinylm's `GPT` with GPT-2's choices (learned positions, pre-norm LayerNorm, GELU in its tanh form,
  biases, output head tied to the embedding), which is what `GPT2LMHeadModel` is;
- `GPT2LMHeadModel` with ``attn_implementation="sdpa"``, loaded with the *same weights*
  (`tinylm.export.weights` converts them), and the benchmark checks that both give the same loss on the
  first batch before timing anything: same shapes, same function;
- for information, on the baby shape: tinylm with the ``tiny`` preset's architecture (RoPE,
  RMSNorm, SwiGLU, no biases) at the same width, depth and heads (other FLOPs, so only its MFU
  compares), and `GPT2LMHeadModel` with ``activation_function="gelu_pytorch_tanh"``: the same
  function as its default "gelu_new" (GELU's tanh form) in one fused kernel, as tinylm computes
  it, rather than spelled out in eight tensor operations. Most of tinylm's lead on the small
  shape is that difference; this row shows how much.

Shapes: "baby" is nanoGPT's README CPU example (4 layers, 4 heads, d_model 128, context 64,
batch 12, the 84 characters of Shakespeare, hence |V| = 84); "gpt2-124m" is GPT-2 small (12
layers, 12 heads, d_model 768, |V| = 50257) at batch 2 x 256 tokens (``--gpt2-batch``,
``--gpt2-context``), which takes a few seconds a step on two cores.

Both sides: float32, dropout 0, train mode, the same random batch every step, the loss
``F.cross_entropy`` over all B x T positions (for `transformers` computed from ``.logits`` rather
than with ``labels=``, which would drop the last position; its KV cache is turned off, since
tinylm builds none in training), and ``torch.optim.AdamW(lr=3e-4, betas=(0.9, 0.95),
weight_decay=0.1, fused=True)``: the fused CPU kernel, faster than the default for-loop and the
foreach variant for both. ``--compile`` wraps each model's forward + loss in ``torch.compile``
(the backward is compiled with it); the optimizer step stays the fused kernel. ``--bf16`` runs
both forward passes under ``torch.autocast("cpu", dtype=torch.bfloat16)`` (weights, gradients and
AdamW stay float32); MFU is still against the float32 matmul.

Timing: ``--repeats`` rounds after a warm-up; in each round every contender runs ``--steps``
steps (one step on the 124M shape), taking turns, in alternating order, so that a change of
machine load hits all alike. The table shows median tokens/s and the median of the per-round
ratios tinylm / transformers. This machine's cores are shared: the load average is printed before
and after, and when it exceeds the core count the absolute numbers mean little (the ratio still
does, mostly).

Threads (``--threads``, printed in the first line): by default PyTorch's one per core, unless the
load average at the start already fills the cores, then 1. With two threads every parallel region
waits for both, so when another process holds one of the two cores a step can take several times
*longer* than with one thread (measured here: 0.1x to 0.5x of the one-thread speed under load, and
1.6x faster than one thread on an idle machine).

MFU (model FLOPs utilization) = tokens/s x training FLOPs per token / a matmul throughput measured
in the same rounds. FLOPs per token come from `tinylm.explain.accounting.flops_per_token` (6 N +
12 n_layer d_model T, the PaLM convention, T the sequence length used); the same number serves
`transformers`, whose shapes are identical. Two matmul throughputs are measured, float32 on the
same threads: "model-shaped", (B T x d) @ (d x 4 d), the MLP's first matrix product, the kind of
product the step is made of; and "peak", a 2048 x 2048 square product. MFU is against the peak.

This is a measurement, not a test.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tinylm.config import GPTConfig, load_preset
from tinylm.explain.accounting import flops_per_token
from tinylm.export.hf import hf_config
from tinylm.export.weights import convert_to_theirs, hf_rules
from tinylm.model import GPT

ADAMW = dict(lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
PEAK_MATMUL = 2048  # side of the square float32 product whose throughput stands for the peak
TINY_ROW = "tinylm, tiny preset's architecture"
FAST_GELU_ROW = 'transformers, activation_function="gelu_pytorch_tanh"'


@dataclass(frozen=True)
class Shape:
    name: str
    config: GPTConfig  # tinylm with GPT-2's choices; its block_size is the context used
    batch: int
    steps: int  # per round
    warmup: int
    repeats: int
    extras: bool = False  # also time the informational contenders (TINY_ROW, FAST_GELU_ROW)


def gpt2_like(vocab_size: int, context: int, n_layer: int, n_head: int, d_model: int) -> GPTConfig:
    """The GPTConfig that computes what GPT2LMHeadModel computes (these are also GPTConfig's defaults)."""
    return GPTConfig(vocab_size=vocab_size, block_size=context, n_layer=n_layer, n_head=n_head, d_model=d_model,
                     positions="learned", norm="layernorm", norm_position="pre", mlp="gelu", bias=True,
                     tie_embeddings=True, dropout=0.0, attention="sdpa")


def tiny_preset_like(config: GPTConfig) -> GPTConfig:
    """The tiny preset's architecture (positions, norm, MLP, bias, ...) at ``config``'s size."""
    tiny = load_preset("tiny")["model"]
    size = {k: getattr(config, k) for k in ("vocab_size", "block_size", "n_layer", "n_head", "d_model")}
    return GPTConfig(**{**tiny, **size, "n_kv_head": None, "d_ff": None})


# ----- the contenders ------------------------------------------------------------------------------


def hf_twin(model: GPT, **overrides: object) -> nn.Module:
    """A GPT2LMHeadModel (SDPA attention) holding ``model``'s weights; ``overrides`` change its GPT2Config."""
    from transformers import AutoModelForCausalLM, GPT2Config

    config = GPT2Config(**{**hf_config(model.config), **overrides})
    theirs = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")  # a GPT2LMHeadModel
    state = convert_to_theirs(model.state_dict(), hf_rules(model.config))
    missing, unexpected = theirs.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)  # the head is tied to wte
    return theirs


def tinylm_loss(model: GPT) -> Callable[[Tensor, Tensor], Tensor]:
    return lambda x, y: model(x, y)[1]


def hf_loss(model: nn.Module) -> Callable[[Tensor, Tensor], Tensor]:
    def loss(x: Tensor, y: Tensor) -> Tensor:
        logits = model(input_ids=x, use_cache=False).logits  # (B, T, |V|)
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    return loss


def training_step(model: nn.Module, loss_fn: Callable[[Tensor, Tensor], Tensor], args: argparse.Namespace):
    """A function doing one step on (x, y): forward, loss, backward, AdamW, zero_grad."""
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    if args.compile:
        loss_fn = torch.compile(loss_fn, mode=args.compile_mode)

    def step(x: Tensor, y: Tensor) -> None:
        # bf16 autocast: matrix products in bfloat16 (float32 weights, gradients and optimizer state)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            loss = loss_fn(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def matmul(m: int, k: int, n: int) -> Callable[[], float]:
    """A function returning the GFLOP/s of one float32 (m x k) @ (k x n) product, timed a few times."""
    a, b = torch.randn(m, k), torch.randn(k, n)
    repeats = max(3, int(2e9 / (2 * m * k * n)))  # about 2 GFLOP a measurement

    def measure() -> float:
        a @ b  # warm
        start = time.perf_counter()
        for _ in range(repeats):
            a @ b
        return 2 * m * k * n * repeats / (time.perf_counter() - start) / 1e9

    return measure


# ----- measuring ------------------------------------------------------------------------------------


def bench_shape(shape: Shape, args: argparse.Namespace) -> dict:
    """Median tokens/s of every contender on ``shape``, per-round ratios to tinylm's, MFU, matmul GFLOP/s."""
    cfg, B = shape.config, shape.batch
    T = cfg.block_size
    torch.manual_seed(0)
    ours = GPT(cfg)
    theirs = hf_twin(ours)
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, cfg.vocab_size, (B, T + 1), generator=g)
    x, y = data[:, :-1].contiguous(), data[:, 1:].contiguous()  # (B, T) inputs and next-token targets

    # same shapes, same weights, same function: the losses agree before anything is timed
    with torch.no_grad():
        a, b = tinylm_loss(ours)(x, y).item(), hf_loss(theirs)(x, y).item()
    if abs(a - b) > 1e-4 * abs(a):
        raise SystemExit(f"{shape.name}: tinylm's loss {a:.6f} and transformers' {b:.6f} differ: not the same model")

    contenders = {"tinylm": (training_step(ours, tinylm_loss(ours), args), cfg),
                  "transformers": (training_step(theirs, hf_loss(theirs), args), cfg)}
    if shape.extras:
        # for information: the tiny preset's architecture at this size, and transformers with the
        # GELU kernel we use (its default, "gelu_new", spells the tanh formula out in 8 tensor ops)
        torch.manual_seed(0)
        tiny = GPT(tiny_preset_like(cfg))
        contenders[TINY_ROW] = (training_step(tiny, tinylm_loss(tiny), args), tiny.config)
        fast = hf_twin(ours, activation_function="gelu_pytorch_tanh")
        contenders[FAST_GELU_ROW] = (training_step(fast, hf_loss(fast), args), cfg)

    warmup = {}
    for name, (step, _) in contenders.items():
        start = time.perf_counter()
        for _ in range(shape.warmup):
            step(x, y)  # first steps allocate the optimizer state, pick kernels, and compile
        warmup[name] = time.perf_counter() - start

    matmuls = {"shaped": matmul(B * T, cfg.d_model, 4 * cfg.d_model),
               "peak": matmul(PEAK_MATMUL, PEAK_MATMUL, PEAK_MATMUL)}
    tokens: dict[str, list[float]] = {name: [] for name in contenders}
    gflops: dict[str, list[float]] = {name: [] for name in matmuls}
    for r in range(shape.repeats):
        for name in list(contenders) if r % 2 == 0 else list(reversed(contenders)):
            step = contenders[name][0]
            start = time.perf_counter()
            for _ in range(shape.steps):
                step(x, y)
            tokens[name].append(B * T * shape.steps / (time.perf_counter() - start))
        for name, measure in matmuls.items():
            gflops[name].append(measure())

    peak = statistics.median(gflops["peak"])
    return {
        "shape": shape, "warmup": warmup, "shaped": statistics.median(gflops["shaped"]), "peak": peak,
        "tok/s": {name: statistics.median(t) for name, t in tokens.items()},
        # tinylm's tokens/s over each contender's, round by round (the load drifts less within a round)
        "ratio": {name: statistics.median(a / b for a, b in zip(tokens["tinylm"], t)) for name, t in tokens.items()},
        "MFU": {name: statistics.median(tokens[name]) * flops_per_token(c, T) / (peak * 1e9)
                for name, (_, c) in contenders.items()},
    }


def print_table(results: list[dict]) -> None:
    header = (f"{'shape':10s} {'B x T':>8s} {'MFLOP/tok':>9s} {'tinylm tok/s':>12s} {'HF tok/s':>9s} {'ratio':>6s} "
              f"{'MFU tinylm':>10s} {'MFU HF':>7s} {'matmul GFLOP/s shaped/peak':>27s}")
    print(header)
    print("-" * len(header))
    for res in results:
        shape, tps, mfu = res["shape"], res["tok/s"], res["MFU"]
        T = shape.config.block_size
        matmuls = f"{res['shaped']:.0f} / {res['peak']:.0f}"
        print(f"{shape.name:10s} {f'{shape.batch} x {T}':>8s} {flops_per_token(shape.config, T) / 1e6:9.1f} "
              f"{tps['tinylm']:12,.0f} {tps['transformers']:9,.0f} {res['ratio']['transformers']:5.2f}x "
              f"{mfu['tinylm']:10.1%} {mfu['transformers']:7.1%} {matmuls:>27s}")
    for res in results:
        if TINY_ROW in res["tok/s"]:
            tps, mfu = res["tok/s"], res["MFU"]
            print(f"\nfor information, {res['shape'].name} shape:")
            print(f"  {TINY_ROW}: {tps[TINY_ROW]:,.0f} tok/s, MFU {mfu[TINY_ROW]:.1%}")
            print(f"  {FAST_GELU_ROW}: {tps[FAST_GELU_ROW]:,.0f} tok/s, MFU {mfu[FAST_GELU_ROW]:.1%}; "
                  f"tinylm / this {res['ratio'][FAST_GELU_ROW]:.2f}x")
    warmups = ", ".join(f"{r['shape'].name} {name} {s:.1f}s" for r in results for name, s in r["warmup"].items()
                        if name in ("tinylm", "transformers"))
    print(f"\nwarm-up (compilation included): {warmups}")
    print("ratio: median over rounds of tinylm's tokens/s / transformers' (GPT2LMHeadModel as configured by default, "
          "gelu_new); MFU against the 'peak' matmul.")


def load() -> str:
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


def choose_threads(setting: str) -> tuple[int, str]:
    """``--threads``: a number, or "auto": every core unless the last minute's load average fills them already."""
    if setting != "auto":
        return int(setting), "--threads"
    cores, busy = os.cpu_count() or 1, os.getloadavg()[0]
    if busy >= cores:
        return 1, f"auto: load average {busy:.1f} >= {cores} cores"
    return torch.get_num_threads(), "auto: PyTorch's default"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="baby,gpt2-124m", help="comma-separated: baby, gpt2-124m")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per round on the baby shape (124M: 1)")
    parser.add_argument("--repeats", type=int, default=7, help="rounds on the baby shape; the table shows medians")
    parser.add_argument("--gpt2-repeats", type=int, default=4, help="rounds on the 124M shape (one step each)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per model first (124M: 1)")
    parser.add_argument("--threads", default="auto",
                        help="torch.set_num_threads; 'auto' (default): PyTorch's one per core on an idle machine, "
                             "1 when the load average says other work holds the cores")
    parser.add_argument("--compile", action="store_true", help="torch.compile each model's forward + loss")
    parser.add_argument("--compile-mode", default="default",
                        help="torch.compile mode with --compile, e.g. max-autotune-no-cudagraphs")
    parser.add_argument("--bf16", action="store_true",
                        help="both models under torch.autocast('cpu', bfloat16) instead of plain float32")
    parser.add_argument("--gpt2-batch", type=int, default=2)
    parser.add_argument("--gpt2-context", type=int, default=256)
    parser.add_argument("--skip-extras", action="store_true",
                        help="leave out the informational contenders on the baby shape")
    args = parser.parse_args()

    import transformers

    transformers.logging.set_verbosity_error()
    threads, why = choose_threads(args.threads)
    torch.set_num_threads(threads)
    shapes = {
        "baby": Shape("baby", gpt2_like(84, 64, n_layer=4, n_head=4, d_model=128), batch=12, steps=args.steps,
                      warmup=args.warmup, repeats=args.repeats, extras=not args.skip_extras),
        "gpt2-124m": Shape("gpt2-124m", gpt2_like(50257, args.gpt2_context, n_layer=12, n_head=12, d_model=768),
                           batch=args.gpt2_batch, steps=1, warmup=min(args.warmup, 1), repeats=args.gpt2_repeats),
    }
    chosen = [s.strip() for s in args.shapes.split(",") if s.strip()]
    unknown = [s for s in chosen if s not in shapes]
    if unknown:
        parser.error(f"unknown shape(s) {', '.join(unknown)}; the shapes are: {', '.join(shapes)}")

    compiled = f"torch.compile(mode={args.compile_mode!r})" if args.compile else "eager"
    print(f"torch {torch.__version__}, transformers {transformers.__version__}; {threads} thread"
          f"{'s' if threads > 1 else ''} ({why}; interop {torch.get_num_interop_threads()}) on {os.cpu_count()} cores; "
          f"{compiled}; "
          f"{'bf16 autocast' if args.bf16 else 'float32'}; "
          f"AdamW fused; rounds: baby {args.repeats} x {args.steps} steps, 124M {args.gpt2_repeats} x 1 step")
    print(f"load average before: {load()}")
    results = [bench_shape(shapes[name], args) for name in chosen]
    print(f"load average after:  {load()}" + ("  (above the core count: other work shared the cores)"
                                             if os.getloadavg()[0] > (os.cpu_count() or 1) else ""))
    print()
    print_table(results)


if __name__ == "__main__":
    main()
