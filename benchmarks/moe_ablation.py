"""Benchmark: the dense default Transformer against Mixture-of-Experts variants, bits per byte, speed and balance.

Run from the repository root::

    python benchmarks/moe_ablation.py --data-dir data/tiny \\
        --variants dense moe8-aux="--moe-experts 8 --moe-top-k 2" \\
                   moe8-bias="--moe-experts 8 --moe-top-k 2 --moe-balance bias" \\
                   moe8-none="--moe-experts 8 --moe-top-k 2 --moe-balance none" \\
                   moe8-aux-time="--moe-experts 8 --moe-top-k 2 @time=dense"

Each variant is one `tinylm train` of the default recipe on the built-in corpus (shards shared through
``--data-dir``), with its extra flags: ``dense`` has none. A Mixture of Experts' default expert width is
d_ff / top_k, so ``--moe-experts 8 --moe-top-k 2`` does the dense model's multiply-adds per token (equal
active parameters in its MLPs) with 8 times the MLP's parameters. ``@time=dense`` gives a variant the
tokens that fit in the dense run's training seconds, from its own measured tokens per second in a first
run of the same variant without it (that run must be listed too): the comparison at equal wall time.

Reported per run: the final bits per byte on the whole validation split, training tokens per second,
the steps, and for a Mixture of Experts the load imbalance at the end (``moe_cv_max``: the largest
coefficient of variation of the experts' loads over the layers, 0 when every expert gets the same
share; the per-layer values too) and whether training warned that a layer collapsed.
This is a measurement, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

TIME_MARK = "@time=dense"


def parse_variant(spec: str) -> tuple[str, list[str]]:
    name, _, flags = spec.partition("=")
    return name, shlex.split(flags)


def train(name: str, flags: list[str], work: Path, common: list[str]) -> dict:
    out = work / name
    done = subprocess.run([sys.executable, "-m", "tinylm", "train", "--out", str(out), "--force", "--no-progress",
                           "--sample-tokens", "0", *common, *flags], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{done.stderr[-3000:]}")
    info = json.loads((out / "run.json").read_text())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in rows if r.get("kind") == "train"][-1]
    cvs = sorted((k, v) for k, v in last.items() if k.startswith("moe_cv_l"))
    return {"variant": name, "flags": " ".join(flags), "bits_per_byte": info["final"]["bits_per_byte"],
            "steps": info["step"], "tokens": info["cost"]["tokens"], "seconds": info["cost"]["training_seconds"],
            "tokens_per_s": info["cost"]["tokens"] / info["cost"]["training_seconds"],
            "cv_max": last.get("moe_cv_max"), "cv_layers": [round(v, 3) for _, v in cvs],
            "collapse_warned": "collapse" in (done.stdout + done.stderr).lower()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variants", nargs="+", default=["dense", "moe8=--moe-experts 8 --moe-top-k 2"],
                        help='NAME or NAME="FLAGS" (module docstring)')
    parser.add_argument("--data-dir", default="data/tiny", help="the shards the runs share (default data/tiny)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--parallel", type=int, default=1, help="trainings at once (a GPU with many cores)")
    parser.add_argument("--work", help="where the runs go (default: a temporary folder)")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    common = ["--data-dir", args.data_dir, "--device", args.device, "--threads", str(args.threads)]
    variants = [parse_variant(v) for v in args.variants]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work or tmp)
        first = [(n, f) for n, f in variants if TIME_MARK not in f]
        with ThreadPoolExecutor(args.parallel) as pool:
            rows = list(pool.map(lambda nf: train(nf[0], nf[1], work, common), first))
        dense = next(r for r in rows if r["variant"] == "dense")
        timed = []
        for name, flags in variants:
            if TIME_MARK in flags:
                plain = [f for f in flags if f != TIME_MARK]
                probe = next(r for r in rows if r["flags"] == " ".join(plain))
                tokens = int(dense["seconds"] * probe["tokens_per_s"])
                timed.append((name, [*plain, "--max-tokens", str(tokens)]))
        with ThreadPoolExecutor(args.parallel) as pool:
            rows += list(pool.map(lambda nf: train(nf[0], nf[1], work, common), timed))
    print("| variant | flags | steps | bits per byte | tokens/s | vs dense | load CV (max; per layer) | collapse warned |")
    print("|---|---|---:|---:|---:|---:|---|---|")
    for r in rows:
        cv = "-" if r["cv_max"] is None else f"{r['cv_max']:.3f}; {', '.join(map(str, r['cv_layers']))}"
        print(f"| {r['variant']} | {r['flags'] or '(default)'} | {r['steps']} | {r['bits_per_byte']:.4f} | "
              f"{r['tokens_per_s']:,.0f} | {r['tokens_per_s'] / dense['tokens_per_s']:.2f}x | {cv} | "
              f"{'yes' if r['collapse_warned'] else 'no'} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
