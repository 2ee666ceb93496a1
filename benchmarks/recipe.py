"""Benchmark: the training recipe one change at a time, every row at the same wall-time budget.

Run from the repository root::

    python benchmarks/recipe.py                          # both tables, 270 s of training a row
    python benchmarks/recipe.py --budget 90              # a quicker ablation table
    python benchmarks/recipe.py --only defaults          # table 1 alone: the default run against classic
    python benchmarks/recipe.py --only ablations --rows "classic,tiny (the default),classic + Muon"
    python benchmarks/recipe.py --only small             # table 3: the small preset, both recipes
    python benchmarks/recipe.py --only speed             # throughput of both recipes, probed in turn

Every row trains on its preset's own data, as `tinylm train --preset P` makes it (Shakespeare, a
byte-level BPE tokenizer of the preset's size, shards in data/, reused once made), and is scored on
the whole validation split in bits per byte, which does not depend on the tokenizer, with the
default evaluation (disjoint windows of block_size tokens). Two tables are printed:

1. **The default run against the classic recipe, as configured**: the `tiny` preset (what
   `tinylm train` runs with no arguments) and the `classic` preset (the lecture notes' recipe, the
   default before this one), each with its own token budget, run one after the other in this
   process; their training time and throughput side by side, and the ratio.
2. **Ablations at equal wall time** (``--budget`` seconds of training a row): "classic + one
   change" for every change of `CHANGES`, and "tiny - one change" for every change the tiny preset
   uses, beside the Kneser-Ney 5-gram (counted on the whole training split of each preset's data,
   not budgeted: it takes about 1.5 s) and the `lstm` preset at the same budget. Equal time, not equal tokens: a row's
   token budget is its throughput, measured in a short probe run before any row trains (so all
   probes see the same machine), times the budget; a faster recipe sees more tokens.
3. **The small preset on stdlib** (6 x 384, context 512, this Python's own source code, BPE 8192)
   at a fixed token budget (``--small-tokens``), trained with the classic preset's recipe (AdamW,
   cosine, its rates) and with the tiny preset's (`RECIPE_KEYS`: optimizer, schedule, options).
4. **Throughput** (``--only speed``, not part of the default): short probes of the classic and the
   tiny presets taken in turn, their median tokens/s and the ratio, the steadier measure on a
   machine whose speed drifts between two full runs.

The changes are read from the presets themselves: a change is a set of settings, and its value in
"classic + change" is the tiny preset's (or `EXTRA`'s for the options tiny does not use), so the
table follows the presets when they change. This is a measurement, not a test; on a shared
machine throughput moves by 10% or more between runs, so compare rows of one table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tinylm.config import load_preset, resolve_config
from tinylm.data import ShardSet
from tinylm.model.ngram import NGramModel
from tinylm.run import load_run, read_metrics
from tinylm.train import prepare_data, train

# A change: its name, the settings it sets. Values come from the tiny preset, or from EXTRA.
CHANGES: dict[str, tuple[str, ...]] = {
    "Muon": ("optimizer", "muon_lr", "muon_momentum", "muon_momentum_warmup", "muon_weight_decay", "lr", "embed_lr"),
    "WSD schedule": ("decay", "decay_fraction", "decay_shape", "min_lr", "warmup_steps"),
    "ReLU^2 MLP": ("mlp",),
    "zero-init projections": ("zero_init_projections",),
    "QK-norm": ("qk_norm",),
    "logit soft-cap": ("logit_softcap",),
    "value embeddings": ("value_embed",),
    "bigram-hash embedding": ("bigram_hash",),
    "untied head": ("tie_embeddings", "head_init_std", "head_lr"),
    "shape and batch": ("n_layer", "d_model", "n_head", "n_kv_head", "d_ff", "block_size", "batch_size",
                        "short_block_size", "long_fraction"),
    "vocabulary": ("tokenizer_vocab_size",),
    "bfloat16 autocast": ("dtype",),
}
# the value of an option for "classic + change" when the tiny preset leaves it off
EXTRA: dict[str, Any] = {
    "mlp": "relu2", "zero_init_projections": True, "qk_norm": True, "logit_softcap": 15.0, "value_embed": True,
    "bigram_hash": 16384, "tie_embeddings": False, "head_init_std": 0.0,
}
# settings every row shares: no periodic evaluation or sample (they are not training), the whole split at the end
COMMON: dict[str, Any] = {"eval_interval": 10**9, "sample_tokens": 0, "final_eval_tokens": 0, "log_interval": 10}


@dataclass
class Row:
    name: str
    params: str
    tokens: int
    train_s: float
    tok_s: float
    bpb: float
    note: str = ""


def flat(preset: str) -> dict[str, Any]:
    """A preset's settings as one dict, key -> value (model and train tables together)."""
    return {k: v for table in load_preset(preset).values() for k, v in table.items()}


def setting(config, key: str) -> Any:
    for table in (config.model, config.train):
        if hasattr(table, key):
            return getattr(table, key)
    raise KeyError(key)


def variants() -> list[tuple[str, str, dict[str, Any]]]:
    """(row name, preset, overrides) for every ablation row, in table order."""
    classic, tiny = resolve_config(preset="classic"), resolve_config(preset="tiny")
    rows = [("classic", "classic", {}), ("tiny (the default)", "tiny", {})]
    plus, minus = [], []
    for change, keys in CHANGES.items():
        theirs = {k: setting(tiny, k) for k in keys if setting(tiny, k) != setting(classic, k)}
        if theirs:  # the default uses it: classic + it, and the default without it
            plus.append((f"classic + {change}", "classic", theirs))
            minus.append((f"tiny - {change}", "tiny", {k: setting(classic, k) for k in theirs}))
        else:
            extra = {k: EXTRA[k] for k in keys if k in EXTRA}
            if extra:
                plus.append((f"classic + {change}", "classic", extra))
    return rows + plus + minus


def overrides_for(overrides: dict[str, Any]) -> dict[str, Any]:
    """A row's settings over its preset: `COMMON`, then the row's own (None written as "none")."""
    return {k: ("none" if v is None else v) for k, v in {**COMMON, **overrides}.items()}


def shards_of(preset: str) -> ShardSet:
    """The shards `tinylm train --preset PRESET` trains on, made (or reused, in data/) exactly as it makes them."""
    return prepare_data(resolve_config(preset=preset).train, log=lambda line: None)


def throughput(run_dir: Path) -> float:
    """Median training tokens/s over a run's logged windows, the first (warm-up) left out."""
    speeds = [r["tokens_per_s"] for r in read_metrics(run_dir) if r["kind"] == "train"]
    return statistics.median(speeds[1:] if len(speeds) > 1 else speeds)


def train_row(name: str, preset: str, overrides: dict[str, Any], folder: Path) -> tuple[Row, Any]:
    config = resolve_config(preset=preset, overrides=overrides)
    out = folder / name.replace(" ", "_").replace("/", "_")
    result = train(config, out, progress=False, log=lambda line: None, force=True)
    model = load_run(out).model  # the trained model: its vocabulary is the tokenizer's, not the preset's placeholder
    n = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    # the time of the training steps (the last training line), without the evaluation at the end
    train_s = [r["elapsed"] for r in read_metrics(out) if r["kind"] == "train"][-1]
    return Row(name, f"{n / 1e6:.2f}M", result.tokens, train_s, throughput(out),
               result.val["bits_per_byte"]), config


def probe(preset: str, overrides: dict[str, Any], folder: Path, steps: int) -> float:
    config = resolve_config(preset=preset, overrides={**overrides, "max_steps": steps, "max_tokens": "none",
                                                      "final_eval_tokens": 4096, "log_interval": 5})
    out = folder / "probe"
    train(config, out, progress=False, log=lambda line: None, force=True)
    return throughput(out)


# what makes a recipe, apart from the model's size and the data: the optimizer, the schedule, the options
RECIPE_KEYS = tuple(k for change, keys in CHANGES.items() if change not in ("shape and batch", "vocabulary") for k in keys)


def recipe_of(preset: str) -> dict[str, Any]:
    """The recipe settings of ``preset`` (`RECIPE_KEYS`), to put on another model."""
    config = resolve_config(preset=preset)
    return {k: setting(config, k) for k in RECIPE_KEYS}


def small_rows(folder: Path, budget_tokens: int, batch_size: int) -> list[Row]:
    """The small preset on stdlib (BPE 8192) at a fixed token budget, with the classic and the tiny recipes."""
    data = {"corpus": "stdlib", "tokenizer_vocab_size": 8192, "max_tokens": budget_tokens, "batch_size": batch_size,
            "max_steps": "none"}
    rows = []
    for name, recipe in (("small + classic recipe", "classic"), ("small + tiny's recipe", "tiny")):
        overrides = overrides_for({**data, **recipe_of(recipe)})
        row, config = train_row(name, "small", overrides, folder)
        row.note = f"{config.train.optimizer}, {config.train.decay}"
        rows.append(row)
        print(f"  {name}: {row.bpb:.4f} bits per byte, {row.tokens:,} tokens in {row.train_s:.0f} s",
              file=sys.stderr, flush=True)
    return rows


def speed_rows(folder: Path, repeats: int, steps: int) -> None:
    """Training throughput of the classic and the tiny presets, probed in turn (ABAB...): medians and ratios.

    One pair of full runs (table 1) sees whatever the machine's neighbours did during each; short
    probes taken in turn see the same conditions, so their median ratio is the steadier measure.
    """
    speeds: dict[str, list[float]] = {"classic": [], "tiny": []}
    for _ in range(repeats):
        for preset in speeds:
            speeds[preset].append(probe(preset, overrides_for({}), folder, steps))
    classic, tiny = (statistics.median(speeds[p]) for p in ("classic", "tiny"))
    budgets = {p: resolve_config(preset=p).train.max_tokens for p in speeds}
    print(f"\n4. Training throughput, {repeats} probes of {steps} steps each, taken in turn (medians)\n")
    for preset in speeds:
        runs = ", ".join(f"{v:,.0f}" for v in speeds[preset])
        print(f"  {preset}: {statistics.median(speeds[preset]):,.0f} tokens/s ({runs})")
    print(f"\ntiny / classic: tokens/s {tiny / classic:.2f}x; for their budgets ({budgets['tiny']:,} and "
          f"{budgets['classic']:,} tokens) training time {budgets['tiny'] / tiny / (budgets['classic'] / classic):.2f}x")


def print_table(title: str, rows: list[Row]) -> None:
    print(f"\n{title}\n")
    print("| recipe | parameters | training tokens | training time | tokens/s | bits per byte |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        note = f" ({r.note})" if r.note else ""
        print(f"| {r.name}{note} | {r.params} | {r.tokens:,} | {r.train_s:.0f} s | {r.tok_s:,.0f} | {r.bpb:.4f} |")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", type=float, default=270.0, help="seconds of training for each ablation row")
    parser.add_argument("--only", choices=("defaults", "ablations", "small", "speed"), help="print one table only")
    parser.add_argument("--speed-repeats", type=int, default=5, help="alternating probes of each recipe for --only speed")
    parser.add_argument("--small-tokens", type=int, default=300_000, help="training tokens of each small-preset row")
    parser.add_argument("--small-batch", type=int, default=8, help="sequences of 512 tokens a step for the small rows")
    parser.add_argument("--rows", help="comma-separated ablation row names to run (default: all)")
    parser.add_argument("--probe-steps", type=int, default=30, help="optimizer steps of each throughput probe")
    parser.add_argument("--json", help="also write every row to this JSON file")
    args = parser.parse_args(argv)

    # every row trains on its preset's own data (data/shakespeare-bpe-N, made once, then reused), as
    # `tinylm train` does; the Kneser-Ney rows are counted on the classic and the tiny presets' shards
    data = {name: shards_of(name) for name in ("classic", "tiny")}
    for name, shards in data.items():
        meta = shards.meta["splits"]
        print(f"{name}'s data: {shards.path}: {meta['train']['tokens']:,} training and {meta['val']['tokens']:,} "
              f"validation tokens")
    print("every figure: bits per byte over the whole validation split, disjoint windows of block_size tokens")
    out: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        if args.only in (None, "defaults"):
            rows = []
            for name, preset in (("classic", "classic"), ("tiny (the default)", "tiny")):
                row, config = train_row(name, preset, overrides_for({}), folder)
                row.note = f"{config.train.optimizer}, {config.train.decay}"
                rows.append(row)
            classic, tiny = rows
            print_table("1. The default run against the classic recipe, each with its own token budget", rows)
            print(f"\ntiny / classic: training time {tiny.train_s / classic.train_s:.2f}x, tokens/s "
                  f"{tiny.tok_s / classic.tok_s:.2f}x, bits per byte {tiny.bpb - classic.bpb:+.4f}")
            out["defaults"] = [asdict(r) for r in rows]
        if args.only in (None, "ablations"):
            wanted = set(args.rows.split(",")) if args.rows else None
            todo = [v for v in variants() if wanted is None or v[0] in wanted]
            speeds = {}
            for name, preset, overrides in todo + [("lstm preset", "lstm", {})]:
                speeds[name] = probe(preset, overrides_for(overrides), folder, args.probe_steps)
            rows = []
            counted = {}
            for name, shards in data.items():
                if shards.path in counted:
                    continue  # both presets on the same shards: one count
                start = time.perf_counter()
                ngram = NGramModel.fit_shards(shards, 5, smoothing="kn")
                count_s = time.perf_counter() - start
                result = ngram.evaluate_shards(shards, "val")
                vocab = shards.tokenizer().vocab_size
                rows.append(Row(f"Kneser-Ney 5-gram on {name}'s data (|V| {vocab}, counted, not budgeted)", "-",
                                shards.num_tokens("train"), count_s, shards.num_tokens("train") / count_s,
                                result.bits_per_byte))
                counted[shards.path] = True
                del ngram
            for name, preset, overrides in [("lstm preset", "lstm", {})] + todo:
                budget_tokens = int(speeds[name] * args.budget)
                row, _ = train_row(name, preset, overrides_for({**overrides, "max_tokens": budget_tokens,
                                                                "max_steps": "none"}), folder)
                changed = ", ".join(f"{k} = {v}" for k, v in overrides.items())
                row.note = changed
                rows.append(row)
                print(f"  {name}: {row.bpb:.4f} bits per byte, {row.tokens:,} tokens in {row.train_s:.0f} s",
                      file=sys.stderr, flush=True)
            print_table(f"2. Ablations at {args.budget:g} s of training a row (tokens: the probe's tokens/s "
                        f"x the budget)", rows)
            out["ablations"] = [asdict(r) for r in rows]
        if args.only == "speed":
            speed_rows(folder, args.speed_repeats, args.probe_steps)
        if args.only in (None, "small"):
            rows = small_rows(folder, args.small_tokens, args.small_batch)
            print_table(f"3. The small preset (6 x 384, context 512) on stdlib, BPE 8192, {args.small_tokens:,} "
                        f"tokens each ({args.small_batch} x 512 a step)", rows)
            print(f"\ntiny's recipe - classic: {rows[1].bpb - rows[0].bpb:+.4f} bits per byte")
            out["small"] = [asdict(r) for r in rows]
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
