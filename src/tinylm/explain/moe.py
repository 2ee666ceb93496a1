"""Where a Mixture-of-Experts Transformer sends its tokens: per token and layer, and in total over a split.

Each MoE layer's router scores the E experts for every position and sends it through the k best
(`tinylm.model.moe`). Two views of that:

- `routing_of_text`: for one text, the k experts each token went to in each layer and their gate
  weights, in order of weight (the first is the token's top-1 expert);
- `expert_load`: over many tokens (windows of a split, as evaluation reads them), the fraction of the
  N k token-slots each expert got in each layer, and the coefficient of variation of those loads
  (std / mean: 0 when every expert gets the even share 1/E, sqrt(E - 1) when one takes all).

Both record the routing from the model's own forward pass: a hook on each layer's `MoE` routes the
rows that layer is given, with the router and balancing bias it uses. `moe_figure` draws both in
one picture: a grid of tokens by layers coloured by the top-1 expert, and one bar chart of the
loads per layer.

Usage::

    routing = routing_of_text(run.model, run.tokenizer, "To be, or not", start_ids=run.start_ids)
    load = expert_load(run.model, split_tokens(run, "val"), n_tokens=8192)
    print(format_routing(routing)); print(format_load(load))
    plot_moe(routing, load, "moe.png")
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor, nn

from tinylm.atomic import atomic_path
from tinylm.config import FAMILY_NAMES
from tinylm.errors import TinyLMError
from tinylm.evaluate import eval_batch_size, window_starts
from tinylm.explain.attention import text_ids, token_label
from tinylm.model.moe import MoE, Routing, expert_counts, load_cv
from tinylm.tokenizers.base import Tokenizer

if TYPE_CHECKING:
    from tinylm.run import Run

NO_EXPERTS = "train with --moe-experts N"
CELL_TEXT_TOKENS = 40  # a grid of more tokens than this shows the colours alone: the text would not fit


def moe_layers(model: nn.Module) -> list[MoE]:
    """The `MoE` MLP of every block of a Transformer; a one-line error for a dense one or another family."""
    family = getattr(getattr(model, "config", None), "family", None)
    if family != "gpt":
        what = FAMILY_NAMES.get(family, type(model).__name__)
        raise TinyLMError(f"this run holds {what} model, which has no experts: train a Transformer with "
                          "--moe-experts N")
    layers = [block.mlp for block in model.blocks]
    if not all(isinstance(mlp, MoE) for mlp in layers):
        raise TinyLMError(f"this run has no experts: {NO_EXPERTS}")
    return layers


@contextlib.contextmanager
def _eval_mode(model: nn.Module) -> Iterator[None]:
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            yield
    finally:
        model.train(was_training)


def layer_routings(model: nn.Module, idx: Tensor) -> list[Routing]:
    """One forward pass of token ids ``idx`` (B, T) in eval mode: each MoE layer's `Routing` of its B T rows.

    A hook sees the rows each layer's MoE is given and routes them as its forward pass does
    (`MoE.route`: the router, then the top k by score plus the balancing bias).
    """
    layers = moe_layers(model)
    found: dict[int, Routing] = {}

    def recorder(layer: int):
        def hook(module: MoE, inputs: tuple[Tensor, ...]) -> None:
            x = inputs[0]  # (B, T, d): the rows the MoE is given
            found[layer] = module.route(x.reshape(-1, x.size(-1)))[1]
        return hook

    handles = [mlp.register_forward_pre_hook(recorder(i)) for i, mlp in enumerate(layers)]
    try:
        with _eval_mode(model):
            model(idx.to(next(model.parameters()).device))
    finally:
        for handle in handles:
            handle.remove()
    return [found[i] for i in range(len(layers))]


def by_gate(routing: Routing) -> tuple[Tensor, Tensor]:
    """The experts (N, k) and gates (N, k) of a routing, each row reordered by gate weight, largest first.

    The router picks by score plus the balancing bias, so its own order may differ from the weights'.
    """
    order = routing.gates.argsort(dim=-1, descending=True, stable=True)
    return routing.experts.gather(-1, order), routing.gates.gather(-1, order)


@dataclass
class TextRouting:
    """Where each token of a text went: per layer and token, the k experts and their gates, largest gate first."""

    tokens: list[str]  # the tokens' text pieces, as axis labels
    experts: list[list[list[int]]]  # [layer][token] -> k expert ids
    gates: list[list[list[float]]]  # [layer][token] -> their k gate weights
    n_experts: int

    @property
    def top1(self) -> list[list[int]]:
        """[layer][token] -> the expert with the largest gate."""
        return [[chosen[0] for chosen in layer] for layer in self.experts]

    def report(self) -> dict:
        """JSON-ready: the tokens and, per layer, each token's experts and gates."""
        layers = [{"layer": i, "experts": e, "gates": w} for i, (e, w) in enumerate(zip(self.experts, self.gates))]
        return {"tokens": self.tokens, "n_experts": self.n_experts, "layers": layers}


def routing_of_text(model: nn.Module, tokenizer: Tokenizer, text: str, start_ids: Sequence[int] = ()
                    ) -> TextRouting:
    """The experts and gates of every token of ``text`` (after ``start_ids``) in every MoE layer of ``model``."""
    layers = moe_layers(model)
    ids = text_ids(model, tokenizer, text, start_ids)
    experts, gates = [], []
    for routing in layer_routings(model, torch.tensor([ids])):
        e, g = by_gate(routing)
        experts.append(e.tolist())
        gates.append(g.float().tolist())
    return TextRouting([token_label(tokenizer, i) for i in ids], experts, gates, layers[0].n_experts)


@dataclass
class ExpertLoad:
    """How many of the token-slots (tokens x k) each expert got in each layer, over ``tokens`` tokens."""

    counts: list[list[int]]  # [layer][expert]
    tokens: int
    top_k: int

    @property
    def n_experts(self) -> int:
        return len(self.counts[0])

    @property
    def loads(self) -> list[list[float]]:
        """[layer][expert] -> the fraction of the layer's token-slots the expert got (each layer sums to 1)."""
        return [[c / sum(layer) for c in layer] for layer in self.counts]

    @property
    def cvs(self) -> list[float]:
        """Per layer, the coefficient of variation of the loads: std / mean (`tinylm.model.moe.load_cv`)."""
        return [load_cv(torch.tensor(layer)) for layer in self.counts]

    @property
    def even_share(self) -> float:
        """1 / E: every expert's load when the router spreads the tokens evenly."""
        return 1.0 / self.n_experts

    def report(self) -> dict:
        """JSON-ready: the counts, loads and CV of every layer."""
        return {"tokens": self.tokens, "top_k": self.top_k, "even_share": self.even_share,
                "layers": [{"layer": i, "counts": c, "loads": f, "cv": cv}
                           for i, (c, f, cv) in enumerate(zip(self.counts, self.loads, self.cvs))]}


def expert_load(model: nn.Module, tokens: np.ndarray, n_tokens: int = 8192, batch_size: int | None = None
                ) -> ExpertLoad:
    """The experts' loads in every MoE layer over about ``n_tokens`` of ``tokens`` (a split's ids).

    The text is read in windows of the model's block_size, evenly spread over it (all of it when it
    is shorter; `tinylm.evaluate.window_starts`), ``batch_size`` windows a forward pass.
    """
    layers = moe_layers(model)
    if len(tokens) == 0:
        raise TinyLMError("there are no tokens to route: the split is empty")
    block_size = model.config.block_size
    starts = window_starts(len(tokens), block_size, n_tokens)
    windows = [np.asarray(tokens[s : s + block_size], dtype=np.int64) for s in starts]
    batch_size = batch_size or eval_batch_size(block_size)
    counts = torch.zeros(len(layers), layers[0].n_experts, dtype=torch.long)
    by_length: dict[int, list[np.ndarray]] = {}
    for w in windows:  # the last window of a split may be shorter: batch windows of one length together
        by_length.setdefault(len(w), []).append(w)
    for group in by_length.values():
        for i in range(0, len(group), batch_size):
            idx = torch.from_numpy(np.stack(group[i : i + batch_size]))  # (B, T)
            for layer, routing in enumerate(layer_routings(model, idx)):
                counts[layer] += expert_counts(routing.experts, layers[0].n_experts).cpu()
    return ExpertLoad(counts.tolist(), sum(len(w) for w in windows), layers[0].top_k)


def split_tokens(run: Run, split: str = "val", data_dir: str | os.PathLike | None = None) -> np.ndarray:
    """The token ids of ``split`` of the shards ``run`` was trained on (``data_dir`` if they have moved)."""
    from tinylm.data.shards import ShardSet
    from tinylm.tokenizers.base import check_same_tokenizer

    folder = data_dir or run.info.get("data", {}).get("dir")
    if not folder:
        raise TinyLMError(f"{run.path} does not say where its data is; give the shard folder with --data-dir")
    if not Path(folder).is_dir():
        raise TinyLMError(f"the data of {run.path} is not at {folder} any more; give its shard folder with --data-dir")
    shards = ShardSet.open(folder)
    check_same_tokenizer(shards.meta["tokenizer"]["fingerprint"], run.tokenizer,
                         f"the shards in {folder} were made with another tokenizer than {run.path}'s",
                         "give the run's own data folder with --data-dir")
    return shards.tokens(split)


def routing_cell(experts: Sequence[int], gates: Sequence[float]) -> str:
    """One token's routing in one layer as text: "e3 0.71 / e5 0.29"."""
    return " / ".join(f"e{e} {g:.2f}" for e, g in zip(experts, gates))


def format_routing(routing: TextRouting) -> str:
    """A table: a row per token, its text piece then per layer its experts and gates, largest gate first."""
    n_layer = len(routing.experts)
    rows = [[repr(token)] + [routing_cell(routing.experts[layer][t], routing.gates[layer][t])
                             for layer in range(n_layer)] for t, token in enumerate(routing.tokens)]
    header = ["token"] + [f"layer {layer}" for layer in range(n_layer)]
    widths = [max(len(row[c]) for row in [header, *rows]) for c in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [header, *rows]]
    return "\n".join([f"{len(routing.tokens)} tokens, {routing.n_experts} experts, top {len(routing.experts[0][0])}"
                      " (each cell: expert and gate weight, largest first)", *lines])


def format_load(load: ExpertLoad) -> str:
    """A table: a row per layer, each expert's share of the token-slots, then the layer's CV."""
    header = ["layer"] + [f"e{e}" for e in range(load.n_experts)] + ["CV"]
    rows = [[str(layer)] + [f"{x:.3f}" for x in shares] + [f"{cv:.3f}"]
            for layer, (shares, cv) in enumerate(zip(load.loads, load.cvs))]
    widths = [max(len(row[c]) for row in [header, *rows]) for c in range(len(header))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in [header, *rows]]
    return "\n".join([f"load over {load.tokens:,} tokens ({load.tokens * load.top_k:,} token-slots a layer): the "
                      f"share of each expert, even is {load.even_share:.3f}; CV = std / mean", *lines])


def expert_colors(n_experts: int) -> list:
    """A fixed colour per expert id: matplotlib's qualitative tab10 up to 10 experts, tab20 up to 20, then hues."""
    from matplotlib import colormaps

    if n_experts <= 10:
        return [colormaps["tab10"](e) for e in range(n_experts)]
    if n_experts <= 20:
        return [colormaps["tab20"](e) for e in range(n_experts)]
    return [colormaps["hsv"](e / n_experts) for e in range(n_experts)]


def moe_figure(routing: TextRouting, load: ExpertLoad, title: str | None = None):
    """A matplotlib Figure (Agg canvas): the routing grid (tokens across, layers down, coloured by the top-1
    expert, each cell's k experts and gates written in it) above one bar chart of the loads per layer."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.colors import ListedColormap
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    n_layer, T, E = len(routing.experts), len(routing.tokens), routing.n_experts
    colors = expert_colors(E)
    per_row = min(n_layer, 4)
    bar_rows = -(-n_layer // per_row)
    grid_height = 0.6 + 0.55 * n_layer
    width = max(7.0, min(0.6 * T, 20.0) + 2.0, 2.6 * per_row)
    fig = Figure(figsize=(width, grid_height + 1.2 + 2.4 * bar_rows + (0.3 if title else 0)), dpi=100,
                 layout="constrained")
    FigureCanvasAgg(fig)
    spec = fig.add_gridspec(1 + bar_rows, per_row, height_ratios=[grid_height + 1.0] + [2.4] * bar_rows)

    ax = fig.add_subplot(spec[0, :])
    ax.imshow(np.array(routing.top1), cmap=ListedColormap(colors), vmin=-0.5, vmax=E - 0.5, aspect="auto",
              interpolation="nearest")
    if T <= CELL_TEXT_TOKENS:
        for layer in range(n_layer):
            for t in range(T):
                text = "\n".join(f"e{e} {g:.2f}" for e, g in zip(routing.experts[layer][t], routing.gates[layer][t]))
                ax.text(t, layer, text, ha="center", va="center", fontsize=5.5, color="black")
    labels = [token if token.strip() else repr(token) for token in routing.tokens]  # a space, quoted, shows
    ax.set_xticks(range(T), labels, rotation=90, fontsize=7)
    ax.set_yticks(range(n_layer), [f"layer {layer}" for layer in range(n_layer)], fontsize=7)
    ax.set_title("the top-1 expert of each token in each layer (in each cell: the top-k experts and gates)",
                 fontsize=9)
    ax.legend(handles=[Patch(color=colors[e], label=f"e{e}") for e in range(E)], loc="upper left",
              bbox_to_anchor=(1.0, 1.0), fontsize=7, title="expert", title_fontsize=7)

    for layer, (shares, cv) in enumerate(zip(load.loads, load.cvs)):
        bar = fig.add_subplot(spec[1 + layer // per_row, layer % per_row])
        bar.bar(range(E), shares, color=colors)
        bar.axhline(load.even_share, color="black", linestyle="--", linewidth=1, label=f"even 1/{E}")
        bar.set_xticks(range(E), [f"e{e}" for e in range(E)], fontsize=7)
        bar.set_ylim(0, max(max(shares), load.even_share) * 1.15)
        bar.set_title(f"layer {layer}: CV {cv:.3f}", fontsize=8)
        bar.tick_params(axis="y", labelsize=7)
        if layer % per_row == 0:
            bar.set_ylabel("share of token-slots", fontsize=7)
        if layer == 0:
            bar.legend(fontsize=6, loc="upper right")
    fig.suptitle((title + "\n" if title else "") + f"top {load.top_k} of {E} experts; the loads (below) over "
                 f"{load.tokens:,} tokens, the dashed line the even share 1/{E}", fontsize=10)
    return fig


def plot_moe(routing: TextRouting, load: ExpertLoad, path: str | os.PathLike, title: str | None = None) -> Path:
    """Draw `moe_figure` into the PNG file ``path``, atomically (constrained layout, as `plot_attention`)."""
    fig = moe_figure(routing, load, title)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")
    return Path(path)
