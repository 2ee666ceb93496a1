"""Pictures of runs, drawn with matplotlib into PNG files (no display needed): loss curves, the
learning-rate schedule of each optimizer group, and the bits per byte of several models side by
side (`tinylm compare`).

`plot_loss_curve` reads the rows of a run's metrics.jsonl: training lines (``kind`` "train":
the mean training loss since the previous line) and evaluation lines (``kind`` "eval": the
validation loss), both against the optimizer step. Training loss is usually a little below
validation loss; a validation curve that turns upward while the training curve keeps falling is
overfitting.

The figure is drawn on matplotlib's Agg canvas directly, never through pyplot, so it works on
machines without a display and leaves pyplot's global state alone.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from tinylm.atomic import atomic_path


def plot_loss_curve(
    rows: Iterable[Mapping[str, Any]], path: str | os.PathLike, title: str | None = None
) -> Path:
    """Draw training and validation loss against the step into the PNG file ``path`` (atomically)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = list(rows)
    train = [(r["step"], r["loss"]) for r in rows if r.get("kind") == "train"]
    val = [(r["step"], r["val_loss"]) for r in rows if r.get("kind") == "eval"]
    fig = Figure(figsize=(7, 4.2), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    if train:
        ax.plot(*zip(*train), label="training loss", color="tab:blue", linewidth=1.2)
    if val:
        ax.plot(*zip(*val), label="validation loss", color="tab:orange", marker="o", markersize=3.5, linewidth=1.5)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats per token)")
    ax.grid(True, alpha=0.3)
    if train or val:
        ax.legend()
    return save_figure(fig, ax, path, title)


def plot_schedule(
    rates: Mapping[str, list[float]], path: str | os.PathLike, title: str | None = None,
    momentum: list[float] | None = None,
) -> Path:
    """Each optimizer group's learning rate against the step (``rates``: label -> one rate a step) into ``path``.

    Groups whose peaks differ by orders of magnitude (Muon's matrices beside AdamW's embeddings)
    share a logarithmic axis; Muon's momentum, when it warms up, is drawn on a second axis. Groups on
    the same schedule are one line with all their labels, since one line drawn over another hides it.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.2), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    peaks = [max(r) for r in rates.values() if r and max(r) > 0]
    lines: dict[tuple[float, ...], list[str]] = {}
    for label, values in rates.items():
        lines.setdefault(tuple(values), []).append(label)
    for values, labels in lines.items():
        ax.plot(range(1, len(values) + 1), values, label="; ".join(labels), linewidth=1.5)
    if peaks and max(peaks) / min(peaks) > 10:
        ax.set_yscale("log")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("learning rate")
    ax.grid(True, alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if momentum is not None:
        twin = ax.twinx()
        twin.plot(range(1, len(momentum) + 1), momentum, color="tab:gray", linestyle="--", linewidth=1.2,
                  label="Muon momentum")
        twin.set_ylabel("momentum")
        more_handles, more_labels = twin.get_legend_handles_labels()
        handles, labels = handles + more_handles, labels + more_labels
    if handles:
        ax.legend(handles, labels, fontsize=9)
    return save_figure(fig, ax, path, title)


def plot_bits_per_byte(
    labels: list[str], values: list[float], path: str | os.PathLike, title: str | None = None
) -> Path:
    """A horizontal bar per model of its bits per byte (lower is better) into the PNG file ``path``."""
    import math

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 1.2 + 0.45 * len(labels)), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    finite = [v for v in values if math.isfinite(v)]
    top = max(finite) if finite else 1.0
    shown = [v if math.isfinite(v) else top * 1.1 for v in values]  # an infinite one: a bar past the others
    y = list(range(len(labels)))[::-1]  # the first model on top
    bars = ax.barh(y, shown, color=["tab:gray" if not math.isfinite(v) else "tab:blue" for v in values])
    for bar, v in zip(bars, values):
        text = f"{v:.3f}" if math.isfinite(v) else "infinite"
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {text}", va="center", fontsize=9)
    ax.set_yticks(y, labels, fontsize=9)
    ax.set_xlim(0, top * 1.25)
    ax.set_xlabel("bits per byte (lower is better)")
    ax.grid(True, axis="x", alpha=0.3)
    return save_figure(fig, ax, path, title)


def save_figure(fig, ax, path: str | os.PathLike, title: str | None = None) -> Path:
    """Title the axes, lay the figure out and write it as a PNG file, atomically (every picture of tinylm.explain)."""
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")
    return Path(path)
