"""What a model costs: parameters by part, FLOPs per token, KV-cache and activation memory, and how they grow with T.

    from tinylm.config import resolve_config
    from tinylm.explain.cost import cost_report, format_cost, plot_cost
    config = resolve_config(preset="gpt2-124m").model
    print(format_cost(cost_report(config))); plot_cost(config, "cost.png")

The numbers are `tinylm.explain.accounting`'s formulas; this module puts them in one report. The point
the picture makes: the parameters do not depend on the context length T at all, the FLOPs per token grow
linearly in T (each query meets T keys), and the inner products of a whole sequence grow as T^2, so
doubling T quadruples them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from tinylm.config import GPTConfig
from tinylm.errors import TinyLMError
from tinylm.explain.accounting import (activation_bytes, attention_inner_products, attention_layer_params,
                                       attention_layer_weights,
                                       cost_vs_context, exact_flops_per_token, forward_flops_breakdown,
                                       kv_cache_bytes, matmul_params, param_breakdown, training_memory)
from tinylm.explain.plots import save_figure


def cost_report(config: GPTConfig, batch_size: int = 1, seq_len: int | None = None) -> dict[str, Any]:
    """Everything `tinylm explain cost` prints, as one JSON-ready dict (T = seq_len, block_size unless given)."""
    if config.family != "gpt":
        raise TinyLMError(f"the cost accounting is the Transformer's; this is a {config.family} model")
    T = config.block_size if seq_len is None else seq_len
    parts = param_breakdown(config)
    return {
        "context": T,
        "batch_size": batch_size,
        "params": {**parts, "total": sum(parts.values())},
        "attention_layer_weights": attention_layer_weights(config),
        "attention_layer_params": attention_layer_params(config),
        "tied_embeddings": config.tie_embeddings,
        "forward_flops_per_token": forward_flops_breakdown(config, T),
        "flops_per_token": exact_flops_per_token(config, T),
        # the rule with N = the weights that multiply (no lookups, biases or norms), beside its usual all-parameter N
        "rule_6n_matmul": 6 * matmul_params(config) + 12 * config.n_layer * config.n_head * config.head_dim * T,
        "matmul_params": matmul_params(config),
        "inner_products": {"per_sequence": attention_inner_products(config, T),
                           "doubled_context": attention_inner_products(config, 2 * T)},
        "kv_cache_bytes": kv_cache_bytes(config, T),
        "activation_bytes": activation_bytes(config, batch_size, T),
        "training_memory_bytes": training_memory(config),
    }


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    raise AssertionError


def format_cost(report: dict[str, Any]) -> str:
    """The report as aligned plain text."""
    p, f, T = report["params"], report["flops_per_token"], report["context"]
    lines = ["parameters"]
    lines += [f"  {name:<32}{n:>16,}" for name, n in p.items() if n or name == "total"]
    if report["tied_embeddings"]:
        lines.append("  (the output head is tied to the token embedding: counted once)")
    w, n = report["attention_layer_weights"], report["attention_layer_params"]
    lines.append(f"  one attention layer: {w:,} weights (W_q, W_k, W_v, W_o)"
                 + (f", {n:,} with its biases and norm gains" if n != w else ", no biases"))
    lines.append(f"FLOPs per token (context {T})")
    rows = [(f"forward, {name}", n) for name, n in report["forward_flops_per_token"].items()]
    rows += [("forward, exact (the sum)", f["forward"]), ("training, exact (3x forward)", f["training"]),
             ("training, 6N + 12 L n_h d_h T", f["rule_6n"])]
    lines += [f"  {name:<32}{n:>16,}" for name, n in rows]
    # the rule of thumb takes N as every parameter; say so, and what it would be with the exact count's N
    lines.append(f"  (N = all {p['total']:,} parameters, embedding tables too, though a lookup multiplies nothing: "
                 f"{f['rule_6n'] / f['training'] - 1:+.0%} against the exact count; with N = the "
                 f"{report['matmul_params']:,} weights of the matrix multiplications the rule gives "
                 f"{report['rule_6n_matmul']:,})")
    ip = report["inner_products"]
    lines += [f"attention inner products per sequence: {ip['per_sequence']:,} at T = {T}, "
              f"{ip['doubled_context']:,} at T = {2 * T}: "
              f"{ip['doubled_context'] // ip['per_sequence']}x the inner products when T doubles"]
    kv = report["kv_cache_bytes"]
    lines.append(f"KV cache (float32): {_size(kv['per_token'])} per token, {_size(kv['full_context'])} for a full "
                 f"context of {T}")
    act = report["activation_bytes"]
    lines.append(f"activations (float32, batch {report['batch_size']} x {T}): {_size(act['total'])} "
                 f"({_size(act['attention_scores'])} of them the T^2 attention scores)")
    mem = report["training_memory_bytes"]
    lines.append(f"weights + gradients + AdamW state (float32): {_size(mem['total'])}")
    return "\n".join(lines)


def plot_cost(config: GPTConfig, path: str | os.PathLike, contexts: list[int] | None = None,
              title: str | None = None) -> Path:
    """Parameters, training FLOPs per token and inner products per sequence against T (log-log), into ``path``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    top = max(config.block_size, 16)
    contexts = contexts or sorted({max(1, top // 2**k) for k in range(8)} | {2 * top})
    rows = cost_vs_context(config, contexts)
    fig = Figure(figsize=(7, 4.2), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for key, label in (("params", "parameters (no T)"), ("flops_per_token", "training FLOPs per token (6N + 12 L n_h d_h T)"),
                       ("inner_products", "inner products per sequence (~ T^2)")):
        ax.plot(contexts, [r[key] for r in rows], marker="o", markersize=3, label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context length T (tokens)")
    ax.set_ylabel("count")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, ax, path, title)
