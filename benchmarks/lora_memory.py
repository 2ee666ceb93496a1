"""Benchmark: LoRA against full fine-tuning of GPT-2 small's shape: the share trained, peak memory, seconds per step.

Run from the repository root (about six minutes on two quiet cores)::

    python benchmarks/lora_memory.py --threads 2

The model is GPT-2 small as tinylm's ``gpt2-124m`` preset builds it (12 layers, d_model 768, 12 heads,
|V| = 50257, learned positions, LayerNorm, GELU, context 1024) with random weights, saved as a checkpoint
with a made-up byte-level BPE tokenizer of 50257 tokens (no download: the weights' values do not change
what a step costs). Each variant then runs in a process of its own, so that its peak is its own:

- **full**: every weight trains (`tinylm train --init-from`);
- **lora**: rank ``--rank`` (8) on ``--targets`` (all: W_q, W_k, W_v, W_o, W_1, W_2), the rest frozen
  (`tinylm finetune --lora-rank 8`).

Each process builds the model as training does (`tinylm.train.start.build_training_model`: the checkpoint's
weights, the adapter and how LoRA saves memory, the fused AdamW) and takes ``--warmup`` + ``--steps``
optimizer steps through the training loop's own step (`_Trainer._train_step`: autocast, the head, the loss,
clipping, the optimizer) on random batches of ``--batch`` x ``--context`` tokens (default 4 x 256, a laptop's
batch), float32 and the default dtype (``auto``: bfloat16 autocast on a CPU that multiplies bfloat16, where
the head and loss run a slice of positions at a time).

Peak memory is the process's peak resident set (VmHWM): over the whole process, loading included; over the
steps alone (reset with /proc/self/clear_refs once the model is built); and over one evaluation after them
(as the training loop's: float32 on a CPU, the whole logits) of as many tokens as a step. (Not ru_maxrss: a
process started from another counts its parent's peak there.) Seconds per step are the median of the
timed steps, wall-clock and the process's CPU time (user + system, all threads: on a shared machine other
processes stretch the wall-clock far more than the CPU time). ``estimate`` (float32
with the whole head only) is the resident set once the model is built plus what `tinylm explain cost
--lora-rank` says the steps add to the weights.

``--lora-memory`` measures LoRA with other choices of `tinylm.model.lora.LoraMemory` than training's
(``default``), one row each: ``none`` (the adapter alone, as before LoRA saved memory), or any of
``frozen`` (frozen matrices stored in bfloat16 under autocast), ``slices`` (the head and loss in slices in
float32 too) and ``recompute=K`` (every K-th block's activations recomputed), comma-separated: e.g.
``--lora-memory default none frozen slices recompute=1``.

Two switches measure what would lower the peaks of both variants: ``--env MALLOC_MMAP_THRESHOLD_=65536``
gives every large tensor its own pages, which glibc returns when the tensor is freed (by default freed
temporaries can stay resident behind small tensors kept for the backward pass), and ``--sliced-head`` runs
the head and loss a slice of positions at a time in float32 for full fine-tuning too (LoRA does by
default), so that no (B, T, |V|) logits are kept.

This is a measurement, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

GIB = 1024**3


def status_kib(field: str) -> int:
    """A field of /proc/self/status in kB (VmHWM: the peak resident set; VmRSS: the resident set now)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak() -> bool:
    """Start VmHWM again from the resident set now (Linux 4.0 on); False where the system does not allow it."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def bpe_of_size(vocab_size: int):
    """A byte-level BPE tokenizer of exactly ``vocab_size`` tokens, its merges made up (pairs of bytes)."""
    from tinylm.tokenizers.bpe import BPETokenizer

    specials = BPETokenizer([]).vocab_size - 256
    n = vocab_size - 256 - specials
    return BPETokenizer([(i // 256, i % 256) for i in range(n)])


def make_base(folder: Path) -> Path:
    """A checkpoint of the gpt2-124m preset's model, random weights, beside its 50257-token tokenizer."""
    from tinylm.checkpoint import save_checkpoint
    from tinylm.config import resolve_config
    from tinylm.model import build_model

    config = resolve_config(preset="gpt2-124m")
    tokenizer = bpe_of_size(config.model.vocab_size)
    torch.manual_seed(0)
    model = build_model(config.model)
    path = folder / "gpt2-base"
    save_checkpoint(path, model_state=model.state_dict(), optimizer_state=None, rng_state={}, state={"step": 0},
                    config=config, tokenizer=tokenizer)
    return path


class RandomBatches:
    """Batches of random token ids, ``batch`` rows of ``context``: the same rows at every step number."""

    def __init__(self, vocab_size: int, batch: int, context: int) -> None:
        self.vocab_size, self.batch, self.context = vocab_size, batch, context

    def step_batch(self, step: int, grad_accum: int = 1, window: int | None = None):
        from tinylm.train.batches import MicroBatch

        rows = np.random.default_rng(step).integers(0, self.vocab_size, (self.batch * grad_accum, self.context + 1))
        return MicroBatch(rows[:, :-1].copy(), rows[:, 1:].copy())


def lora_memory(spec: str):
    """The `LoraMemory` a ``--lora-memory`` spec names: default, none, or frozen,slices,recompute=K."""
    from tinylm.model.lora import LoraMemory

    if spec == "default":
        return None  # build_training_model's own choice
    chosen = {"frozen_in_compute_dtype": False, "head_in_slices": False, "recompute_every": 0}
    for part in spec.split(",") if spec != "none" else []:
        name, _, value = part.partition("=")
        if name == "frozen":
            chosen["frozen_in_compute_dtype"] = True
        elif name == "slices":
            chosen["head_in_slices"] = True
        elif name == "recompute":
            chosen["recompute_every"] = int(value or 1)
        else:
            raise SystemExit(f"--lora-memory: unknown {part!r} (default, none, or frozen,slices,recompute=K)")
    return LoraMemory(**chosen)


def worker(args: argparse.Namespace) -> dict:
    """One variant in this process: build it as training does, take the steps, measure (see the module docstring)."""
    import dataclasses

    from tinylm.config import Config
    from tinylm.evaluate import evaluate_tokens
    from tinylm.model.lora import count_adapter
    from tinylm.model.memory import check_fits
    from tinylm.run import load_checkpoint
    from tinylm.train.distributed import Distributed
    from tinylm.train.loop import _Trainer
    from tinylm.train.moe import MoETraining
    from tinylm.train.start import build_training_model

    torch.set_num_threads(args.threads)
    rss_before = status_kib("VmRSS") * 1024  # Python, PyTorch and tinylm, before the model
    init = load_checkpoint(args.base)
    train = dataclasses.replace(init.config.train, batch_size=args.batch, grad_accum=1, dtype=args.dtype,
                                optimizer="adamw", lora_rank=args.rank if args.variant == "lora" else 0,
                                lora_targets=args.targets,
                                threads=args.threads, compile=False)
    config = Config(init.config.model, train)
    check_fits(config.model, config.train)  # a LoRA run that fits must not be refused
    built = build_training_model(config, Distributed(), init, None,
                                 lora_memory(args.lora_spec) if args.variant == "lora" else None)
    trained, total = count_adapter(built.model)
    rss_built = status_kib("VmRSS") * 1024
    # loading's peak: VmHWM, this process's own (ru_maxrss starts from the parent's peak: it counts the memory
    # the process had at exec, which was its parent's)
    loading_peak = status_kib("VmHWM") * 1024
    steps_reset = reset_peak()
    trainer = SimpleNamespace(
        tc=train, ctx=Distributed(), config=config, total=args.warmup + args.steps, device=torch.device("cpu"),
        source=RandomBatches(config.model.vocab_size, args.batch, args.context), model=built.model, ddp=None,
        fsdp=False, head_in_slices=built.head_in_slices or args.sliced_head, autocast=built.autocast,
        step_model=built.step_model, optimizer=built.optimizer,
        moe=MoETraining(built.model, config.model, Distributed()))  # nothing for a dense model
    seconds, cpu_seconds = [], []
    for step in range(args.warmup + args.steps):
        started, cpu_started = time.perf_counter(), time.process_time()
        float(_Trainer._train_step(trainer, step).loss_sum)
        if step >= args.warmup:
            seconds.append(time.perf_counter() - started)
            cpu_seconds.append(time.process_time() - cpu_started)
    steps_peak = status_kib("VmHWM") * 1024 if steps_reset else None
    # an evaluation as the loop's (`_Trainer._evaluate`: float32 on a CPU, whole logits) of as many tokens as a
    # step: a LoRA run under autocast reads its frozen float32 matrices back for it
    eval_reset = reset_peak()
    data = np.random.default_rng(0).integers(0, config.model.vocab_size, args.batch * args.context + 1)
    evaluate_tokens(built.eval_model, data, len(data), 0, block_size=args.context, batch_size=args.batch)
    eval_peak = status_kib("VmHWM") * 1024 if eval_reset else None
    return {"variant": args.variant, "lora_memory": args.lora_spec, "dtype": args.dtype, "trained": trained,
            "params": total, "cpu_step_s": statistics.median(cpu_seconds), "cpu_step_seconds": cpu_seconds,
            "head_in_slices": trainer.head_in_slices, "rss_before": rss_before, "rss_built": rss_built,
            "process_peak": max(loading_peak, steps_peak or 0, eval_peak or 0), "loading_peak": loading_peak,
            "steps_peak": steps_peak, "eval_peak": eval_peak, "step_s": statistics.median(seconds),
            "step_seconds": seconds}


def run_variant(base: Path, variant: str, spec: str, dtype: str, args: argparse.Namespace) -> dict:
    """`worker` in a fresh Python process, with ``--env``'s settings; its one line of JSON."""
    command = [sys.executable, __file__, "--worker", variant, "--lora-spec", spec, "--dtype", dtype,
               "--base", str(base), "--threads", str(args.threads), "--batch", str(args.batch),
               "--context", str(args.context), "--rank", str(args.rank), "--targets", args.targets,
               "--steps", str(args.steps),
               "--warmup", str(args.warmup), *(["--sliced-head"] if args.sliced_head else [])]
    env = {**os.environ, **dict(pair.split("=", 1) for pair in args.env)}
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{variant} {spec} ({dtype}) failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def estimate(base: Path, args: argparse.Namespace) -> dict:
    """`tinylm explain cost`'s LoRA table for this model and batch (float32 bytes)."""
    from tinylm.config import resolve_config
    from tinylm.explain.cost import lora_cost_report
    from tinylm.model.lora import LoraSettings

    config = resolve_config(preset="gpt2-124m").model
    settings = LoraSettings(args.rank, 2.0 * args.rank, 0.0, args.targets)
    return lora_cost_report(config, settings, batch_size=args.batch, seq_len=args.context)


def table(rows: dict[tuple[str, str], dict], est: dict, args: argparse.Namespace, command: str) -> str:
    """The measurements as a markdown table, with the command that made them; each LoRA row against full's."""
    lora = rows[(args.dtypes[0], f"lora {args.lora_memory[0]}")]
    base_share = lora["trained"] / (lora["params"] - lora["trained"])
    extra = "".join(f", {pair}" for pair in args.env) + (", full's head in slices in float32 too"
                                                         if args.sliced_head else "")
    lines = [f"`{command}`", "",
             f"GPT-2 124M shape (random weights), batch {args.batch} x {args.context} tokens, {args.threads} threads, "
             f"LoRA rank {args.rank} on {args.targets}: {lora['trained']:,} numbers trained, {base_share:.2%} of the "
             f"base's {lora['params'] - lora['trained']:,}; s/step: medians of {args.steps} steps after "
             f"{args.warmup} of warm-up, wall-clock and CPU time{extra}", "",
             "| dtype | variant | peak RSS (process) | peak RSS (steps) | peak RSS (eval) | estimate (steps) | s/step "
             "| CPU s/step |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for dtype in args.dtypes:
        full = rows[(dtype, "full")]
        for name in ["full", *(f"lora {spec}" for spec in args.lora_memory)]:
            r = rows[(dtype, name)]
            e = est["full" if name == "full" else "lora"]
            # float32 with the whole head: the RSS once built, plus what `tinylm explain cost` says the steps add
            guess = (f"{(r['rss_built'] + e['peak'] - e['weights']) / GIB:.2f} GiB"
                     if dtype == "float32" and not r["head_in_slices"] else "")
            label = name if name != "lora default" else "**lora**"
            vs = (lambda key: "" if name == "full" else f" ({r[key] / full[key]:.2f}x)")
            steps, evals = ("" if r[key] is None else f"{_gib(r[key])}{vs(key)}" for key in ("steps_peak", "eval_peak"))
            lines.append(f"| {dtype} | {label} | {r['process_peak'] / GIB:.2f} GiB{vs('process_peak')} | {steps} | "
                         f"{evals} | {guess} | {r['step_s']:.2f}{vs('step_s')} | {r['cpu_step_s']:.2f}"
                         f"{vs('cpu_step_s')} |")
    return "\n".join(lines)


def _gib(n: int | None) -> str:
    return "" if n is None else f"{n / GIB:.2f} GiB"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2, help="CPU threads of each process (default: 2)")
    parser.add_argument("--batch", type=int, default=4, help="rows per step (default: 4)")
    parser.add_argument("--context", type=int, default=256, help="tokens per row (default: 256)")
    parser.add_argument("--rank", type=int, default=8, help="LoRA's rank (default: 8)")
    parser.add_argument("--targets", default="all", help="LoRA's targets (default: all)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per variant (default: 5)")
    parser.add_argument("--warmup", type=int, default=2, help="steps before the timed ones (default: 2)")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "auto"], help="default: float32 auto")
    parser.add_argument("--base", help="a gpt2-124m checkpoint to use (default: made in a temporary folder)")
    parser.add_argument("--env", nargs="*", default=[], metavar="NAME=VALUE",
                        help="environment of the measured processes, e.g. MALLOC_MMAP_THRESHOLD_=65536")
    parser.add_argument("--sliced-head", action="store_true",
                        help="full fine-tuning's head and loss a slice of positions at a time in float32 too (LoRA "
                        "does so by default)")
    parser.add_argument("--lora-memory", nargs="+", default=["default"], metavar="SPEC",
                        help="LoRA rows to measure, each a LoraMemory: default (training's), none, or frozen,slices,"
                        "recompute=K (default: default)")
    parser.add_argument("--lora-spec", default="default", help=argparse.SUPPRESS)
    parser.add_argument("--worker", choices=("full", "lora"), help=argparse.SUPPRESS)
    parser.add_argument("--dtype", default="auto", help=argparse.SUPPRESS)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.worker:
        args.variant = args.worker
        print(json.dumps(worker(args)))
        return
    command = "python " + shlex.join(["benchmarks/lora_memory.py", *sys.argv[1:]])
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(args.base) if args.base else make_base(Path(tmp))
        rows = {}
        for dtype in args.dtypes:
            for variant, spec in [("full", "default"), *(("lora", spec) for spec in args.lora_memory)]:
                name = "full" if variant == "full" else f"lora {spec}"
                rows[(dtype, name)] = run_variant(base, variant, spec, dtype, args)
                print(f"# {dtype} {name}: {json.dumps(rows[(dtype, name)])}", file=sys.stderr)
        print(table(rows, estimate(base, args), args, command))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
