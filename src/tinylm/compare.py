"""`tinylm compare`: several trained models, of any family and tokenizer, on the same text.

Bits per byte is the one number that compares language models across tokenizers: a model's
total code length for the text, -sum log2 p(x_t | x_<t), divided by the text's UTF-8 bytes. A
character model predicts many easy tokens, a BPE model fewer harder ones; per byte they measure
the same thing. So an n-gram model, an LSTM and a Transformer trained on the same corpus line up
in one table even when each has its own vocabulary.

Which text: each run's own validation split by default. The split is made per document from the
text alone (a hash of each document), so runs trained on the same corpus with the same
``val_fraction`` hold out the same documents whatever their tokenizers; the table checks that
the byte counts agree and says so when they do not. ``--corpus`` evaluates every run on one
given text instead (tokenized with each run's own tokenizer).

How the networks read it: in disjoint windows of each run's block_size by default, or in sliding
windows with ``stride`` (`tinylm.evaluate`: more context per target, usually a lower loss for the
same model); the table and the chart say which. An n-gram model reads its own context either way.

Usage::

    rows = compare_runs(["runs/ngram", "runs/lstm", "runs/tiny"])
    rows = compare_runs(["runs/lstm", "runs/tiny"], stride=64)     # sliding windows
    print(format_table(rows)); plot_comparison(rows, "compare.png")

On a benchmark task instead (`compare_task`: `tinylm.task_eval`), at several numbers of shots::

    curves = compare_task(["runs/ngram", "runs/lstm", "runs/tiny"], "mc:cloze", shots=[0, 1, 2, 4, 8])
    print(format_task_table(curves)); plot_task_curves(curves, "icl.png")   # accuracy against shots
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tinylm.data.corpora import Corpus
from tinylm.device import use_threads
from tinylm.errors import TinyLMError
from tinylm.evaluate import EvalResult, check_split_or_corpus, check_stride, corpus_text, evaluate_model, split_text, window_size

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@dataclass
class Compared:
    """One model of a comparison: what it is and how it did."""

    name: str  # the run folder's name
    family: str
    size: str  # "2.6M parameters", or the n-gram model's table size
    tokenizer: str  # "bpe |V|=4096"
    result: EvalResult


def compare_runs(
    runs: Sequence[str | os.PathLike],
    *,
    split: str = "val",
    corpus: str | Corpus | None = None,
    max_tokens: int = 0,
    stride: int | None = None,
    device: str = "cpu",
    threads: int | None = None,
    log: Callable[[str], None] | None = None,
) -> list[Compared]:
    """Evaluate every run (`tinylm.run.load_run`) on its ``split``, or all on ``corpus``; ``stride``: sliding
    windows for every network (1..its block_size; None: disjoint windows). ``threads``: CPU threads; None
    follows `tinylm.device.use_threads` (busy cores left out, said to ``log``)."""
    from tinylm.data.shards import ShardSet
    from tinylm.run import load_run

    if not runs:
        raise TinyLMError("give at least one run folder to compare")
    check_split_or_corpus(split, corpus, runs="each run's")
    names = run_labels(runs)
    loaded = [load_run(path, device=device) for path in runs]  # every run and stride checked before any work
    for run, name in zip(loaded, names):
        check_stride(stride, window_size(run.model, run.config.model.block_size), f" of {name}")
    with use_threads(device, threads, log=log):  # once every run is checked: an error there stays one line
        return _evaluate_each(runs, names, loaded, split, corpus, max_tokens, stride, device)


def _evaluate_each(runs: Sequence[str | os.PathLike], names: list[str], loaded: list, split: str,
                   corpus: str | Corpus | None, max_tokens: int, stride: int | None, device: str) -> list[Compared]:
    from tinylm.data.shards import ShardSet

    rows = []
    for path, name, run in zip(runs, names, loaded):
        if corpus is not None:
            text = corpus_text(corpus, run.tokenizer)
        else:
            folder = run.info.get("data", {}).get("dir")
            if not folder or not Path(folder).is_dir():
                raise TinyLMError(f"the data of {path} is not at {folder!r} any more; compare on a corpus with "
                                  "--corpus, or prepare the data again")
            text = split_text(ShardSet.open(folder), split)
        result = evaluate_model(run.model, text, run.tokenizer, block_size=run.config.model.block_size,
                                max_tokens=max_tokens, stride=stride, device=device)
        rows.append(Compared(name, run.family, _size(run.model),
                             f"{run.tokenizer.kind} |V|={run.tokenizer.vocab_size}", result))
    return rows


def run_labels(runs: Sequence[str | os.PathLike]) -> list[str]:
    """A short name per run: its folder's name, with as many parent folders as it takes to tell runs apart
    (runs/a/m and runs/b/m are a/m and b/m)."""
    parts = [Path(os.path.abspath(p)).parts for p in runs]
    labels = []
    for i, own in enumerate(parts):
        depth = 1
        while depth < len(own) and any(other[-depth:] == own[-depth:] for j, other in enumerate(parts)
                                       if j != i and other != own):
            depth += 1
        labels.append("/".join(own[-depth:]))
    return labels


def _size(model) -> str:
    from tinylm.model import NGramLM

    if isinstance(model, NGramLM):
        return f"{_count(sum(len(k) for k in model.ngram.keys))} n-grams"
    return f"{_count(sum(p.numel() for p in model.parameters()))} parameters"


def _count(n: int) -> str:
    """1234 -> '1.2k', 2_600_000 -> '2.60M'."""
    return f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.1f}k" if n >= 1e3 else str(n)


def same_text(rows: Sequence[Compared]) -> bool:
    """Whether every model read the same text (same split bytes, or no proration differences)."""
    return len({round(r.result.bytes) for r in rows if not r.result.prorated}) <= 1


def windows_label(rows: Sequence[Compared]) -> str:
    """How the networks among ``rows`` read the text, for the chart's title: "disjoint windows", "sliding
    windows, stride 8", or "no windows" when all are n-gram models."""
    kinds = sorted({"disjoint windows" if r.result.windows == "disjoint"
                    else f"sliding windows, stride {r.result.stride}" for r in rows if r.result.windows != "none"})
    return " and ".join(kinds) if kinds else "no windows"


def _windows_line(rows: Sequence[Compared]) -> str:
    """The table's line saying how the text was read (the chart's title says it shortly)."""
    label = windows_label(rows)
    ngram = "; n-gram models read their own context" if any(r.result.windows == "none" for r in rows) else ""
    if label == "no windows":
        return "windows: none (n-gram models read their own context)"
    if label == "disjoint windows":
        return ("windows: disjoint, each network's block_size long (a target sees only the tokens before it in its "
                f"own window){ngram}")
    if " and " not in label:
        stride = next(r.result.stride for r in rows if r.result.windows == "sliding")
        least = "block_size" if stride == 1 else f"block_size - {stride - 1}"
        return (f"windows: sliding, each network's block_size long, stride {stride} (every target scored once, "
                f"with at least {least} tokens of context after the first window){ngram}")
    return f"windows: {label}: these rows were not evaluated the same way{ngram}"


def format_table(rows: Sequence[Compared]) -> str:
    """The comparison as a plain-text table, best bits per byte first."""
    header = ("run", "family", "size", "tokenizer", "tokens", "bytes", "loss/token", "perplexity", "bits/byte",
              "time")
    lines = [header]
    for r in sorted(rows, key=lambda r: r.result.bits_per_byte):
        res = r.result
        lines.append((r.name, r.family, r.size, r.tokenizer, f"{res.tokens:,}", f"{res.bytes:,.0f}",
                      _number(res.loss), _number(res.perplexity, 2), _number(res.bits_per_byte), f"{res.seconds:.2f} s"))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    out = ["  ".join(c.ljust(w) if i < 4 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths)))
           for line in lines]
    out.insert(1, "  ".join("-" * w for w in widths))
    out.append(_windows_line(rows))
    if not same_text(rows):
        out.append("note: these models were evaluated on texts of different sizes (their validation splits "
                   "differ); use --corpus to evaluate all of them on one text")
    unknown = [r for r in rows if r.result.unknown_tokens]
    if unknown:
        out.append("note: " + "; ".join(f"{r.name}: {r.result.unknown_tokens:,} <unk> token"
                                         f"{'' if r.result.unknown_tokens == 1 else 's'}" for r in unknown)
                   + ". Each byte they stand for is charged 8 bits in bits per byte (the tokenizer cannot spell it)")
    if any(r.result.prorated for r in rows):
        out.append("note: rows with prorated bytes were scored on evenly spaced windows of the text (--tokens), "
                   "the others on all of it: the same measure on different samples of the text")
    return "\n".join(out)


def _number(x: float, digits: int = 4) -> str:
    return f"{x:.{digits}f}" if math.isfinite(x) else "inf"


def check_plot_path(path: str | os.PathLike) -> Path:
    """The chart's path, if writing it replaces nothing but an older chart (checked before any work is done)."""
    path = Path(path)
    if path.suffix.lower() != ".png":
        raise TinyLMError(f"the chart is a PNG file; give a path ending in .png, not {path}")
    if path.is_dir() or (path.exists() and path.read_bytes()[:8] != PNG_MAGIC):
        raise TinyLMError(f"{path} exists and is not a PNG image; choose another --plot path")
    return path


def plot_comparison(rows: Sequence[Compared], path: str | os.PathLike) -> Path:
    """The bar chart of bits per byte, one bar per model, best on top as in the table (PNG)."""
    from tinylm.explain.plots import plot_bits_per_byte

    path = check_plot_path(path)
    rows = sorted(rows, key=lambda r: r.result.bits_per_byte)  # the table's order: best on top
    labels = [f"{r.name} ({r.family}, {r.tokenizer})" for r in rows]
    text = rows[0].result.split if rows else ""
    if text in ("val", "train"):
        text = f"the {text} split" if same_text(rows) else f"each run's own {text} split (they differ)"
    return plot_bits_per_byte(labels, [r.result.bits_per_byte for r in rows], path,
                              title=f"bits per byte on {text} ({windows_label(rows)})")


# ----- runs side by side on a benchmark task ---------------------------------------------------------------------


@dataclass
class TaskCurve:
    """One run's scores on a task, one per number of shots (its in-context learning curve)."""

    name: str
    family: str
    results: list  # tinylm.task_eval.TaskResult, one per number of shots


def compare_task(
    runs: Sequence[str | os.PathLike],
    task: str,
    *,
    shots: Sequence[int] = (0,),
    items: int = 200,
    seed: int | None = None,
    train_file: str | None = None,
    device: str = "cpu",
    threads: int | None = None,
    log: Callable[[str], None] | None = None,
) -> list[TaskCurve]:
    """Every run (any family) on one benchmark task (`tinylm.task_eval.evaluate_run_task`) at each number of shots,
    on the same items and the same shots (``seed``: None is `tinylm.task_eval.SHOT_SEED`)."""
    from tinylm.data.mc_tasks import load_task
    from tinylm.run import load_run
    from tinylm.task_eval import SHOT_SEED, evaluate_run_task

    if not runs:
        raise TinyLMError("give at least one run folder to compare")
    load_task(task, n=1, train_file=train_file)  # a misspelt task or a bad file: refused before any run loads
    loaded = [load_run(path, device=device) for path in runs]
    curves = []
    for name, run in zip(run_labels(runs), loaded):
        results = evaluate_run_task(run, task, shots=shots, items=items, seed=SHOT_SEED if seed is None else seed,
                                    train_file=train_file, device=device, threads=threads, log=log)
        log = None  # the threads line once
        curves.append(TaskCurve(name, run.family, results))
    return curves


def format_task_table(curves: Sequence[TaskCurve]) -> str:
    """Runs as rows, numbers of shots as columns: accuracy, and accuracy_norm in brackets for multiple choice."""
    first = curves[0].results[0]
    norm = first.accuracy_norm is not None
    header = ("run", "family", *(f"{r.shots}-shot" for r in curves[0].results))
    lines = [header]
    for curve in curves:
        cells = [f"{100 * r.accuracy:.1f}%" + (f" ({100 * r.accuracy_norm:.1f}%)" if norm else "")
                 for r in curve.results]
        lines.append((curve.name, curve.family, *cells))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    out = ["  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths)))
           for line in lines]
    out.insert(1, "  ".join("-" * w for w in widths))
    chance = "" if first.chance is None else f", chance {100 * first.chance:.1f}%"
    what = "accuracy (accuracy_norm: by log-likelihood per byte)" if norm else "exact match of the greedy answer"
    out.append(f"{first.task}: {first.kind}, {first.n} test items; {what}{chance}")
    return "\n".join(out)


def plot_task_curves(curves: Sequence[TaskCurve], path: str | os.PathLike) -> Path:
    """Accuracy against the number of shots, one line per run, chance as a dashed line (PNG): the in-context
    learning curve."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from tinylm.explain.plots import save_figure

    path = check_plot_path(path)
    fig = Figure(figsize=(6.4, 4.2), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for curve in curves:
        ax.plot([r.shots for r in curve.results], [100 * r.accuracy for r in curve.results], marker="o",
                label=f"{curve.name} ({curve.family})")
    first = curves[0].results[0]
    if first.chance is not None:
        ax.axhline(100 * first.chance, color="gray", linestyle="--", label=f"chance ({100 * first.chance:.0f}%)")
    ax.set_xticks(sorted({r.shots for curve in curves for r in curve.results}))
    ax.set_xlabel("examples in the prompt (shots)")
    ax.set_ylabel("accuracy (%)" if first.accuracy_norm is not None else "exact match (%)")
    ax.set_ylim(0, 100)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, ax, path, title=f"{first.task}: {first.n} test items")
