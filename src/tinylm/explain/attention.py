"""Masked attention, shown: a worked 3 x 3 example by hand-sized numbers, and heatmaps of a trained model's weights.

    from tinylm.explain.attention import worked_example, attention_of_text, plot_attention
    print(format_example(worked_example()))          # T = 3, d_h = 2, c = 1: weights and output
    maps = attention_of_text(run.model, run.tokenizer, "To be, or not", start_ids=run.start_ids)
    plot_attention(maps, "attention.png")            # a panel per layer and head

`worked_example` runs tinylm's own `reference_attention` (the formula line for line) on queries,
keys and values given directly, T = 3 and d_h = 2, with the scaling constant c = 1: row t of the
weights is softmax_j(q_t k_j^T + M[t, j]) with M's upper triangle -inf, and the output row t is
sum_j p[t, j] v_j. Row 3, for instance: q_3 = (1, 0) against k_1, k_2, k_3 gives 2, 0, 1, so the
weights are e^2, e^0, e^1 over 11.107 = (0.665, 0.090, 0.245).

A heatmap's row i is how position i spreads its attention over positions 0..i; the cells above the
diagonal, the future that the -inf entries of M hide, are left undrawn (NaN) rather than drawn as 0.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from tinylm.atomic import atomic_path
from tinylm.errors import TinyLMError
from tinylm.generate.inspect import attention_maps
from tinylm.generate.steps import fit_prompt
from tinylm.model.attention import reference_attention
from tinylm.tokenizers.base import Tokenizer

# The worked example's rows: q_t, k_t, v_t for t = 1, 2, 3. Row 1 of the weights is (1, 0, 0) whatever
# q_1 is (only k_1 is visible to it), so q_1 only shows up in the scores.
EXAMPLE_Q = ((1.0, 0.0), (0.0, 1.0), (1.0, 0.0))
EXAMPLE_K = ((2.0, 0.0), (0.0, 1.0), (1.0, 1.0))
EXAMPLE_V = ((1.0, 0.0), (0.0, 1.0), (1.0, 1.0))


@dataclass
class AttentionExample:
    """One head's masked attention written out: inputs (T, d_h), scores, M, weights (T, T), output (T, d_h)."""

    q: Tensor
    k: Tensor
    v: Tensor
    scale: float  # c: the scores are q_t k_j^T / c
    scores: Tensor  # Q K^T / c, before the mask
    mask: Tensor  # M: 0 on and below the diagonal, -inf above
    weights: Tensor  # softmax_row(scores + M)
    output: Tensor  # weights V

    def report(self) -> dict:
        """The example as JSON-ready lists (the -inf entries of M as the string "-inf")."""
        rows = lambda t: [[_finite_or_text(x) for x in row] for row in t.tolist()]  # noqa: E731
        return {"c": self.scale, "q": rows(self.q), "k": rows(self.k), "v": rows(self.v), "scores": rows(self.scores),
                "mask": rows(self.mask), "weights": rows(self.weights), "output": rows(self.output)}


def _finite_or_text(x: float) -> float | str:
    return x if math.isfinite(x) else ("-inf" if x < 0 else "inf")


def masked_attention(q: Tensor, k: Tensor, v: Tensor, scale: float | None = None) -> AttentionExample:
    """One head of causal attention on q, k, v (T, d_h) by `reference_attention`, with every step kept.

    ``scale`` is c (default sqrt(d_h), the model's). `reference_attention` divides by sqrt(d_h), so q
    is multiplied by sqrt(d_h) / c before the call, which leaves q k^T / c.
    """
    T, hs = q.shape
    c = math.sqrt(hs) if scale is None else scale
    y, weights = reference_attention((q * (math.sqrt(hs) / c))[None, None], k[None, None], v[None, None],
                                     return_weights=True)  # (1, 1, T, hs), (1, 1, T, T)
    M = torch.zeros(T, T).masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))  # (T, T)
    return AttentionExample(q, k, v, c, q @ k.T / c, M, weights[0, 0], y[0, 0])


def worked_example() -> AttentionExample:
    """The 3 x 3 example (T = 3, d_h = 2, c = 1): weights (1, 0, 0), (0.269, 0.731, 0), (0.665, 0.090, 0.245)."""
    return masked_attention(torch.tensor(EXAMPLE_Q), torch.tensor(EXAMPLE_K), torch.tensor(EXAMPLE_V), scale=1.0)


def format_example(example: AttentionExample) -> str:
    """The example as text, every number to 3 decimals, in the order it is computed."""
    def matrix(t: Tensor) -> str:
        return "\n".join("  [" + "  ".join(f"{x:7.3f}" if math.isfinite(x) else f"{'-inf':>7}" for x in row) + "]"
                         for row in t.tolist())

    T, hs = example.q.shape
    return "\n".join([
        f"masked attention, T = {T}, d_h = {hs}, c = {example.scale:g} (rows are positions 1..{T})",
        "Q (row t is q_t):", matrix(example.q),
        "K:", matrix(example.k),
        "V:", matrix(example.v),
        "scores Q K^T / c (entry t, j is q_t k_j^T / c):", matrix(example.scores),
        "M (-inf above the diagonal: the future is hidden):", matrix(example.mask),
        "weights softmax_row(Q K^T / c + M) (each row sums to 1):", matrix(example.weights),
        "output weights V (row t is sum_j p_tj v_j):", matrix(example.output),
    ])


@dataclass
class AttentionMaps:
    """A text's attention weights in a model: the token labels and, per layer, (n_head, T, T)."""

    tokens: list[str]
    layers: list[Tensor]
    layer_numbers: list[int]  # which layers ``layers`` holds (all, or the one picked)
    head_numbers: list[int]  # which heads each holds

    def report(self) -> dict:
        """JSON-ready: the tokens and every panel's weights, None above the diagonal (the masked future)."""
        panels = []
        for layer, w in zip(self.layer_numbers, self.layers):
            for i, head in enumerate(self.head_numbers):
                rows = [[round(x, 6) if j <= t else None for j, x in enumerate(row)] for t, row in enumerate(w[i].tolist())]
                panels.append({"layer": layer, "head": head, "weights": rows})
        return {"tokens": self.tokens, "panels": panels}


def token_label(tokenizer: Tokenizer, token_id: int) -> str:
    """A token as an axis label: its text with newlines and tabs escaped (special tokens by name)."""
    text = tokenizer.token_bytes(token_id).decode("utf-8", errors="replace")
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace("\t", "\\t")


def fit_text(model: nn.Module, tokenizer: Tokenizer, text: str, start_ids: Sequence[int] = ()
             ) -> tuple[list[int], str | None]:
    """``start_ids`` then the tokens of ``text``, the sequence as the model reads a document; a text longer than
    the context keeps its last block_size tokens (`tinylm.generate.steps.fit_prompt`: the warning line, or None)."""
    ids = list(start_ids) + tokenizer.encode(text)
    if not ids:
        raise TinyLMError("the text is empty; give some text with --text")
    return fit_prompt(ids, model.config.block_size)


def text_ids(model: nn.Module, tokenizer: Tokenizer, text: str, start_ids: Sequence[int] = ()) -> list[int]:
    """`fit_text`'s tokens, its warning given with `warnings.warn` (the CLI prints it as one line)."""
    ids, warning = fit_text(model, tokenizer, text, start_ids)
    if warning is not None:
        warnings.warn(warning, stacklevel=2)
    return ids


def attention_of_text(model: nn.Module, tokenizer: Tokenizer, text: str, start_ids: Sequence[int] = (),
                      layer: int | None = None, head: int | None = None) -> AttentionMaps:
    """The attention weights of ``text`` in ``model``: every layer and head, or the one ``layer``/``head`` picks."""
    ids = text_ids(model, tokenizer, text, start_ids)
    maps = attention_maps(model, ids)  # per layer (n_head, T, T); an error for a model without attention
    n_layer, n_head = len(maps), maps[0].size(0)
    if layer is not None and not 0 <= layer < n_layer:
        raise TinyLMError(f"--layer {layer} is out of range: the model has layers 0..{n_layer - 1}")
    if head is not None and not 0 <= head < n_head:
        raise TinyLMError(f"--head {head} is out of range: the model has heads 0..{n_head - 1}")
    layers = list(range(n_layer)) if layer is None else [layer]
    heads = list(range(n_head)) if head is None else [head]
    picked = [maps[i][heads].float().cpu() for i in layers]  # each (len(heads), T, T)
    return AttentionMaps([token_label(tokenizer, i) for i in ids], picked, layers, heads)


def attention_figure(maps: AttentionMaps, title: str | None = None):
    """A matplotlib Figure (Agg canvas) with one heatmap a (layer, head): layers down, heads across."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows, cols = len(maps.layers), len(maps.head_numbers)
    T = len(maps.tokens)
    panel = 2.2 if T <= 16 else 3.2
    fig = Figure(figsize=(0.6 + panel * cols + 0.8, 0.4 + panel * rows + (0.3 if title else 0)), dpi=100,
                 layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, squeeze=False)
    future = torch.ones(T, T, dtype=torch.bool).triu(1)
    step = max(1, math.ceil(T / 24))  # label every token up to 24, then every step-th
    ticks = list(range(0, T, step))
    labels = [maps.tokens[i] for i in ticks]
    image = None
    for r, (layer, w) in enumerate(zip(maps.layer_numbers, maps.layers)):
        for c, head in enumerate(maps.head_numbers):
            ax = axes[r][c]
            shown = w[c].masked_fill(future, float("nan")).numpy()  # NaN: not drawn
            image = ax.imshow(shown, vmin=0.0, vmax=1.0, cmap="viridis", interpolation="nearest")
            ax.set_title(f"layer {layer}, head {head}", fontsize=8)
            ax.set_xticks(ticks, labels, rotation=90, fontsize=6)
            ax.set_yticks(ticks, labels, fontsize=6)
            if r == rows - 1:
                ax.set_xlabel("key (attended to)", fontsize=7)
            if c == 0:
                ax.set_ylabel("query", fontsize=7)
    fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.8, label="attention weight")
    if title:
        fig.suptitle(title, fontsize=10)
    return fig


def plot_attention(maps: AttentionMaps, path: str | os.PathLike, title: str | None = None) -> Path:
    """Draw `attention_figure` into the PNG file ``path``, atomically.

    Not `plots.save_figure`: its tight_layout would undo the constrained layout that makes room for
    the colorbar shared by every panel.
    """
    fig = attention_figure(maps, title)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")
    return Path(path)
