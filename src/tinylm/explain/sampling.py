"""The next-token distribution before and after each sampling filter, at several temperatures.

    from tinylm.explain.sampling import explain_logits, format_sampling, plot_sampling
    table = explain_logits([2, 1, -1], temperatures=[1, 2, 0.01])
    print(format_sampling(table)); plot_sampling(table, "sampling.png")

The filters are `tinylm.generate.sampling`'s, the ones every sampler uses, applied in its order:
temperature, then top-k, then top-p. Each stage is the distribution `sampling_distribution` gives
with the filters up to that one switched on, so the last stage is exactly what a sample is drawn from.

The worked example: logits u = (2, 1, -1). At tau = 1, softmax(u) = (0.705, 0.259, 0.035): the first
token is the most likely, but the other two together still get almost three draws in ten. At tau = 2
the gaps halve: (0.547, 0.331, 0.122). At tau = 0.01 the logits become (200, 100, -100) and the second
token's probability is e^100 / (e^200 + e^100 + e^-100), about e^-100 = 3.7e-44: nearly (1, 0, 0), the
argmax every time (tau = 0 *is* greedy decoding). Dividing by tau never reorders the tokens.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from tinylm.errors import TinyLMError
from tinylm.explain.plots import save_figure
from tinylm.generate.inspect import drawable_logits, top_ids
from tinylm.generate.sampling import SamplingParams, sampling_distribution
from tinylm.generate.steps import keep_prompt
from tinylm.run import Run


@dataclass
class SamplingTable:
    """For the tokens shown (``labels``, ids ``token_ids``) and each temperature: the probability at each stage.

    ``stages[t][stage]`` lists one probability per token shown; stage is "temperature", then "top_k" and
    "top_p" where those filters are on. Probabilities are over the whole vocabulary, so with a model the
    tokens shown (the most likely ones) may sum to less than 1.
    """

    labels: list[str]
    token_ids: list[int]
    logits: list[float]
    temperatures: list[float]
    top_k: int | None
    top_p: float | None
    stages: list[dict[str, list[float]]]

    def to_json(self) -> dict:
        return {"tokens": [{"id": i, "token": s, "logit": u} for i, s, u in zip(self.token_ids, self.labels, self.logits)],
                "top_k": self.top_k, "top_p": self.top_p,
                "temperatures": [{"temperature": t, "stages": s} for t, s in zip(self.temperatures, self.stages)]}


def stage_params(temperature: float, top_k: int | None, top_p: float | None) -> dict[str, SamplingParams]:
    """The `SamplingParams` of each stage: the filters up to and including that one."""
    stages = {"temperature": SamplingParams(temperature=temperature)}
    if top_k:
        stages["top_k"] = SamplingParams(temperature=temperature, top_k=top_k)
    if top_p is not None and top_p < 1:
        stages["top_p"] = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    return stages


def explain_distribution(logits: Tensor, temperatures: Sequence[float], top_k: int | None = None,
                         top_p: float | None = None, shown: Sequence[int] | None = None,
                         labels: Sequence[str] | None = None) -> SamplingTable:
    """The distribution over logits (V,) at each temperature and stage, for the ids ``shown`` (default: all)."""
    if not temperatures:
        raise TinyLMError("give at least one temperature, e.g. --temperatures 0.5,1,2")
    shown = list(range(logits.numel())) if shown is None else list(shown)
    row = logits.reshape(1, -1)  # (1, V)
    stages = []
    for t in temperatures:
        params = stage_params(t, top_k, top_p)  # SamplingParams checks each value (a negative tau, p > 1, ...)
        stages.append({name: sampling_distribution(row, p)[0, shown].tolist() for name, p in params.items()})
    return SamplingTable(list(labels) if labels is not None else [f"token {i}" for i in shown], shown,
                         logits[shown].tolist(), list(temperatures), top_k, top_p, stages)


def explain_logits(logits: Sequence[float], temperatures: Sequence[float], top_k: int | None = None,
                   top_p: float | None = None) -> SamplingTable:
    """`explain_distribution` of logits given by hand (in float64, so tiny probabilities such as e^-100 survive)."""
    if len(logits) < 1:
        raise TinyLMError("--logits needs at least one number, e.g. --logits 2,1,-1")
    return explain_distribution(torch.tensor(list(logits), dtype=torch.float64), temperatures, top_k, top_p)


def explain_run(run: Run, text: str, temperatures: Sequence[float], top_k: int | None = None,
                top_p: float | None = None, top: int = 10) -> SamplingTable:
    """The next-token distribution of a trained run after ``text``, for its ``top`` most likely tokens."""
    # a text longer than the context: its last block_size tokens, with the warning `tinylm next-token` gives
    ids = keep_prompt(list(run.start_ids) + run.tokenizer.encode(text), run.config.model.block_size)
    logits = drawable_logits(run.model, run.tokenizer, ids).double()  # (V,), -inf where no sample may go
    shown = top_ids(logits, top)
    labels = [_display(run.tokenizer.token_bytes(i)) for i in shown]
    return explain_distribution(logits, temperatures, top_k, top_p, shown, labels)


def _display(token: bytes) -> str:
    try:
        return repr(token.decode("utf-8"))
    except UnicodeDecodeError:
        return repr(token)


def format_sampling(table: SamplingTable) -> str:
    """A plain-text table: one line a token, one column per temperature and stage."""
    columns = [(t, name) for t, stages in zip(table.temperatures, table.stages) for name in stages]
    heads = [f"T={t:g}" + ("" if name == "temperature" else f" {_stage_name(table, name)}") for t, name in columns]
    width = max(10, *(len(h) for h in heads))
    lines = [f"{'token':<16}  {'logit':>8}" + "".join(f"  {h:>{width}}" for h in heads)]
    for n, (label, u) in enumerate(zip(table.labels, table.logits)):
        probs = [table.stages[table.temperatures.index(t)][name][n] for t, name in columns]
        lines.append(f"{label:<16}  {u:>8.3f}" + "".join(f"  {_prob(p):>{width}}" for p in probs))
    return "\n".join(lines)


def _stage_name(table: SamplingTable, stage: str) -> str:
    return f"top-k {table.top_k}" if stage == "top_k" else f"top-p {table.top_p:g}"


def _prob(p: float) -> str:
    return f"{p:.4f}" if p == 0 or p >= 1e-4 else f"{p:.2e}"  # e^-100 shows as 3.72e-44, not 0.0000


def plot_sampling(table: SamplingTable, path: str | os.PathLike, title: str | None = None) -> Path:
    """One panel per temperature: a group of bars per token, one bar per stage, into the PNG file ``path``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    n = len(table.temperatures)
    fig = Figure(figsize=(3.2 * n + 0.6, 3.6), dpi=110)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, n, sharey=True, squeeze=False)[0]
    x = list(range(len(table.labels)))
    for ax, t, stages in zip(axes, table.temperatures, table.stages):
        width = 0.8 / len(stages)
        for k, (name, probs) in enumerate(stages.items()):
            label = f"softmax(u / {t:g})" if name == "temperature" else f"then {_stage_name(table, name)}"
            ax.bar([i + (k - (len(stages) - 1) / 2) * width for i in x], probs, width, label=label)
        ax.set_xticks(x, table.labels, rotation=45 if len(x) > 4 else 0, fontsize=8)
        ax.set_title(f"temperature {t:g}", fontsize=10)
        ax.set_ylim(0, 1)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_ylabel("probability")
    return save_figure(fig, axes[0], path, title)
