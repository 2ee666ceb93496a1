"""What a model costs: parameters by part, FLOPs per token, KV-cache and activation memory, and how they grow with T.

    from tinylm.config import resolve_config
    from tinylm.explain.cost import cost_report, format_cost, plot_cost
    config = resolve_config(preset="gpt2-124m").model
    print(format_cost(cost_report(config))); plot_cost(config, "cost.png")

The numbers are `tinylm.explain.accounting`'s formulas; this module puts them in one report. The point
the picture makes: the parameters do not depend on the context length T at all, the FLOPs per token grow
linearly in T (each query meets T keys), and the inner products of a whole sequence grow as T^2, so
doubling T quadruples them.

With LoRA settings (`lora_cost_report`, ``tinylm explain cost --lora-rank 8``) the report adds what a
float32 training step holds under LoRA and under full fine-tuning, side by side: the numbers trained,
their gradients and optimizer state, the activations and the step's peak. LoRA's saving is the frozen
weights' gradients and optimizer state; it saves almost no activations (`lora_activation_bytes`).
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
from tinylm.model.lora import LoraSettings, target_names
from tinylm.model.memory import BYTES_PER_VALUE, count_active_params, expert_params, lora_matrix_shapes

# float32 training's (B, T, |V|) tensors at the start of the backward pass, when a step's memory peaks: the
# logits, their log-softmax (which the loss keeps) and the two gradients the backward pass makes of them
# (bfloat16 training on a CPU computes the head and the loss a slice of positions at a time and keeps none)
LOSS_COPIES = 4
OPTIMIZER_NAMES = {"adamw": "AdamW", "muon": "Muon", "sgd": "SGD"}


def cost_report(config: GPTConfig, batch_size: int = 1, seq_len: int | None = None,
                lora: LoraSettings | None = None, optimizer: str = "adamw") -> dict[str, Any]:
    """Everything `tinylm explain cost` prints, as one JSON-ready dict (T = seq_len, block_size unless given);
    with ``lora``, LoRA against full fine-tuning under ``optimizer`` too (`lora_cost_report`)."""
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
        "active_params": count_active_params(config),
        **({"moe": moe_report(config)} if config.moe_experts else {}),
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
        **({"lora": lora_cost_report(config, lora, batch_size, T, optimizer)} if lora is not None else {}),
    }


def moe_report(config: GPTConfig) -> dict[str, int]:
    """A Mixture of Experts' shape per layer: experts, how many a token takes, their width and parameters, the router."""
    return {"experts": config.moe_experts, "top_k": config.moe_top_k, "shared": config.moe_shared_experts,
            "expert_d_ff": config.moe_hidden_dim, "expert_params": expert_params(config, config.moe_hidden_dim),
            "router_params": config.d_model * config.moe_experts}


def format_moe(moe: dict[str, int], total: int, active: int) -> str:
    """The Mixture-of-Experts lines of the parameter table: all the parameters, and those one token goes through."""
    shared = " and the shared one" if moe["shared"] else ""
    return (f"  Mixture of Experts: {moe['experts']} experts a layer of {moe['expert_params']:,} parameters each "
            f"(hidden width {moe['expert_d_ff']}), router {moe['router_params']:,}; a token goes through "
            f"{moe['top_k']}{shared}\n"
            f"  {'active per token':<32}{active:>16,}  ({active / total:.0%} of the total; the FLOPs below are "
            "the active ones)")


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
    if "moe" in report:
        lines.append(format_moe(report["moe"], p["total"], report["active_params"]))
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
    if "lora" in report:
        lines.append(format_lora_cost(report["lora"]))
    return "\n".join(lines)


def lora_activation_bytes(config: GPTConfig, settings: LoraSettings, tokens: int) -> int:
    """What an adapter adds to the activations a float32 step keeps, for ``tokens`` positions (B T).

    Each corrected matrix keeps x A^T, r numbers a token, for B's gradient. Nothing is saved in exchange: a
    frozen W needs no gradient of its own, but the input x it multiplies is still kept, since A's gradient
    needs it (and it is the same tensor that the layer's norm or activation keeps anyway). With dropout each
    target drops its own copy of x, kept with its mask (a byte a number).
    """
    shapes = lora_matrix_shapes(config)
    per_token = 0
    for name in target_names(settings.targets):
        if name in shapes:
            per_token += settings.rank * BYTES_PER_VALUE
            if settings.dropout:
                per_token += shapes[name][0] * (BYTES_PER_VALUE + 1)
    return config.n_layer * tokens * per_token


def step_activation_bytes(config: GPTConfig, batch_size: int, seq_len: int,
                          lora: LoraSettings | None = None) -> dict[str, int]:
    """The activations a float32 training step holds at the start of its backward pass, by part: what the layers
    keep (`activation_bytes`), the T^2 attention scores unless the fused kernel (sdpa) spares them, `LOSS_COPIES`
    of the logits, and an adapter's own (`lora_activation_bytes`)."""
    act = activation_bytes(config, batch_size, seq_len)
    tokens = batch_size * seq_len
    parts = {"layers": act["layers"],
             "attention_scores": 0 if config.attention == "sdpa" else act["attention_scores"],
             "logits": LOSS_COPIES * tokens * config.vocab_size * BYTES_PER_VALUE}
    if lora is not None:
        parts["adapter"] = lora_activation_bytes(config, lora, tokens)
    return parts


def lora_cost_report(config: GPTConfig, settings: LoraSettings, batch_size: int = 1, seq_len: int | None = None,
                     optimizer: str = "adamw") -> dict[str, Any]:
    """A float32 training step under LoRA ``settings`` and under full fine-tuning: numbers trained, bytes of weights,
    gradients, optimizer state and activations, and the step's peak, each with LoRA's share of full's.

    The peak is the weights, the optimizer state and the larger of the activations and the gradients: gradients
    are made (from None, after each step's zero_grad) as the backward pass frees the activations, so a step
    peaks as its backward pass begins unless the gradients outweigh what the layers kept.
    """
    T = config.block_size if seq_len is None else seq_len
    report: dict[str, Any] = {"rank": settings.rank, "alpha": settings.alpha, "scale": settings.scale,
                              "dropout": settings.dropout, "batch_size": batch_size, "context": T,
                              "optimizer": optimizer,
                              "targets": [name for name in target_names(settings.targets)
                                          if name in lora_matrix_shapes(config)],
                              "sdpa": config.attention == "sdpa"}
    for name, rank in (("full", 0), ("lora", settings.rank)):
        memory = training_memory(config, BYTES_PER_VALUE, optimizer, rank, settings.targets)
        activations = step_activation_bytes(config, batch_size, T, settings if rank else None)
        report[name] = {"trainable_params": memory["gradients"] // BYTES_PER_VALUE, "weights": memory["weights"],
                        "gradients": memory["gradients"], "optimizer_state": memory["optimizer"],
                        "activations": sum(activations.values()), "activation_parts": activations}
        report[name]["peak"] = (memory["weights"] + memory["optimizer"]
                                + max(report[name]["activations"], memory["gradients"]))
    report["ratio"] = {key: report["lora"][key] / report["full"][key] if report["full"][key] else 0.0
                       for key in ("trainable_params", "weights", "gradients", "optimizer_state", "activations",
                                   "peak")}
    return report


def format_lora_cost(lora: dict[str, Any]) -> str:
    """`lora_cost_report` as a small table: full fine-tuning, LoRA, and LoRA's share of each."""
    opt = OPTIMIZER_NAMES.get(lora["optimizer"], lora["optimizer"])
    lines = [f"LoRA against full fine-tuning (float32, {opt}, batch {lora['batch_size']} x {lora['context']}): rank "
             f"{lora['rank']}, alpha {lora['alpha']:g} (scale {lora['scale']:g}) on {', '.join(lora['targets'])}",
             f"  {'':<26}{'full':>16}{'LoRA':>16}{'LoRA / full':>14}"]
    full, low, ratio = lora["full"], lora["lora"], lora["ratio"]
    lines.append(f"  {'trainable parameters':<26}{full['trainable_params']:>16,}{low['trainable_params']:>16,}"
                 f"{ratio['trainable_params']:>14.2%}")
    for key, label in (("weights", "weights"), ("gradients", "gradients"), ("optimizer_state", f"{opt} state"),
                       ("activations", "activations"), ("peak", "step's peak")):
        share = f"{ratio[key]:.2g}x" if ratio[key] < 0.1 else f"{ratio[key]:.2f}x"
        lines.append(f"  {label:<26}{_size(full[key]):>16}{_size(low[key]):>16}{share:>14}")
    lines += [
        "  LoRA keeps no gradient and no optimizer state for the frozen weights, but about the same activations: a",
        "  frozen W needs no gradient of its own, yet each corrected matrix's input x is still kept (A's gradient",
        "  needs it), and x A^T adds r numbers a token per matrix",
        f"  activations: what the layers keep{' (no T^2 scores under sdpa)' if lora['sdpa'] else ''} and the "
        f"{LOSS_COPIES} x B T |V| floats float32's backward",
        "  pass begins with (the logits, their log-softmax and two gradients); step's peak: weights + optimizer state",
        "  + the larger of activations and gradients (the backward pass makes the one as it frees the other)"]
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
