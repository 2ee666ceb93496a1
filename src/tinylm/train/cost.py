"""What a Transformer run costs: the table written at its start, the rate measured at its end.

At the start, `write_cost_table` puts cost.json in the run folder, from the formulas of
`tinylm.explain.accounting`: the parameters by component (a tied head counted once, checked
against the built model's own count), the FLOPs a token costs forward and in training
(6 N + 12 n_layer n_h d_h T), the bytes a KV cache holds per token, and the memory of the
weights, gradients and optimizer state.

At the end, `run_cost` says what the run achieved and how that compares with the hardware::

    achieved FLOP/s = training FLOPs per token x tokens trained / seconds spent training
    MFU             = achieved FLOP/s / measured matmul peak

The seconds are read back from the training rows of metrics.jsonl (each row's tokens over its
tokens/s): the loop's timing windows leave out evaluation and checkpoint saving, and the rows of
earlier sessions of a resumed run are still there, so the rate covers the whole run.

The peak is measured, not looked up (`matmul_peak`): a fraction of a second of the model's own
largest matrix products, the MLP's d -> d_ff and the head's d -> |V| over a micro-batch of tokens
(at most 1024 rows on a CPU), on the training device, with its thread count and dtype (bfloat16 when
training autocasts). A step also runs attention, norms, the optimizer and Python, so MFU stays
well under 1 on a small model; a short probe on a shared CPU can also read low, which puts MFU a
little over 1 at times. Under DDP the peak is one process's times the number of processes.

The probe draws no random numbers (its matrices are `torch.ones`) and runs after the last step,
so a run's numbers are those it would have without it.

Only Transformer runs have a table: the FLOP formula is the Transformer's. Recurrent runs write no
cost.json and print no cost line (their run.json's ``cost`` is null); n-gram runs are counted.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tinylm.atomic import atomic_write_text
from tinylm.config import Config
from tinylm.device import precision_name
from tinylm.explain.accounting import (
    flops_per_token,
    forward_flops_breakdown,
    kv_cache_bytes_per_token,
    param_breakdown,
    training_memory,
)
from tinylm.jsonfile import JSONFormat
from tinylm.run import COST_FILE, METRICS_FILE, read_metrics

COST_FORMAT = JSONFormat("tinylm.cost", 1, foreign="{path} is not a tinylm cost table (cost.json of a run)")
PROBE_SECONDS = 0.25  # the whole matmul probe, all shapes together


def has_cost(config: Config) -> bool:
    """Whether a run of ``config`` has a cost table (the Transformer's)."""
    return config.model.family == "gpt"


def cost_table(config: Config, model: nn.Module) -> dict[str, Any]:
    """cost.json's contents for ``model``, built from ``config`` (see the module docstring)."""
    mc = config.model
    forward = forward_flops_breakdown(mc)
    return {
        **COST_FORMAT.header(),
        # parameters() yields a shared (tied) tensor once, so this counts the tied head once
        "parameters": sum(p.numel() for p in model.parameters()),
        "parameters_by_component": param_breakdown(mc),
        "context": mc.block_size,
        "flops_per_token": {"forward": sum(forward.values()), "training": flops_per_token(mc),
                            "forward_by_part": forward},
        "kv_cache_bytes_per_token": {"float32": kv_cache_bytes_per_token(mc, 4),
                                     "bfloat16": kv_cache_bytes_per_token(mc, 2)},
        "training_memory_bytes": training_memory(mc, 4, config.train.optimizer),
    }


def write_cost_table(out: Path, config: Config, model: nn.Module) -> None:
    """cost.json in the run folder ``out``, for a Transformer run (nothing for other families)."""
    if has_cost(config):
        atomic_write_text(out / COST_FILE, json.dumps(cost_table(config, model), indent=1) + "\n")


def read_cost_table(out: str | Path) -> dict[str, Any]:
    return COST_FORMAT.read(Path(out) / COST_FILE)


# ----- the measured side ----------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def matmul_peak(shapes: Sequence[tuple[int, int, int]], device: torch.device, dtype: torch.dtype,
                seconds: float = PROBE_SECONDS) -> float:
    """The best FLOP/s of (m, k) @ (k, n) products of ``shapes``, timed for about ``seconds`` in all.

    The matrices are `torch.ones` (no random numbers drawn); each shape gets an equal share of the
    time, in rounds of calls doubled until a round lasts 5 ms, and the fastest round counts."""
    best = 0.0
    for m, k, n in shapes:
        a = torch.ones(m, k, dtype=dtype, device=device)  # (m, k)
        b = torch.ones(k, n, dtype=dtype, device=device)  # (k, n)
        c = a @ b  # (m, n); the first call also warms up the kernel
        calls, deadline = 1, time.perf_counter() + seconds / len(shapes)
        while True:
            _sync(device)
            start = time.perf_counter()
            for _ in range(calls):
                torch.matmul(a, b, out=c)
            _sync(device)
            now = time.perf_counter()
            best = max(best, calls * 2 * m * k * n / max(now - start, 1e-9))
            if now >= deadline:
                break
            if now - start < 0.005:
                calls *= 2
    return best


def probe_shapes(config: Config, device: torch.device) -> list[tuple[int, int, int]]:
    """The model's MLP and head products over a micro-batch of tokens (capped so the probe stays short)."""
    mc = config.model
    rows = min(config.train.batch_size * mc.block_size, 1024 if device.type == "cpu" else 16384)
    return [(rows, mc.d_model, mc.hidden_dim), (rows, mc.d_model, mc.vocab_size)]


def training_time(rows: Sequence[Mapping[str, Any]]) -> tuple[int, float]:
    """(tokens, seconds) of training over the metrics ``rows``: each training row's new tokens over its tokens/s."""
    tokens, seconds, before = 0, 0.0, 0
    for row in rows:
        if row.get("kind") != "train":
            continue
        new = row["tokens"] - before
        before = row["tokens"]
        if new > 0 and row.get("tokens_per_s"):
            tokens += new
            seconds += new / row["tokens_per_s"]
    return tokens, seconds


def run_cost(out: Path, config: Config, device: torch.device, world_size: int = 1) -> dict[str, Any] | None:
    """What the finished run in ``out`` achieved against a matmul peak measured now; None for a run with no
    cost table. Call it where the run trained: on its device, with its threads."""
    if not has_cost(config):
        return None
    mc = config.model
    forward, training = sum(forward_flops_breakdown(mc).values()), flops_per_token(mc)
    tokens, seconds = training_time(read_metrics(out / METRICS_FILE))
    bf16 = precision_name(device, config.train.dtype) == "bfloat16 autocast"
    peak = matmul_peak(probe_shapes(config, device), device, torch.bfloat16 if bf16 else torch.float32)
    peak *= world_size  # each process has its own device (or share of the cores)
    achieved = training * tokens / seconds if seconds > 0 else 0.0
    return {"flops_per_token_forward": forward, "flops_per_token_training": training, "tokens": tokens,
            "training_seconds": seconds, "achieved_flops_per_s": achieved, "peak_flops_per_s": peak,
            "peak_dtype": "bfloat16" if bf16 else "float32", "mfu": achieved / peak if peak > 0 else 0.0}


def _millions(n: float) -> str:
    """29.5 (one decimal), or three significant digits under a million (a test-sized model's 0.0812)."""
    return f"{n / 1e6:,.1f}" if n >= 1e6 else f"{n / 1e6:.3g}"


def _per_s(flops: float) -> str:
    for unit, size in (("TFLOP/s", 1e12), ("GFLOP/s", 1e9)):
        if flops >= size:
            return f"{flops / size:.2f} {unit}"
    return f"{flops / 1e6:.2f} MFLOP/s"


def cost_lines(cost: Mapping[str, Any] | None) -> list[str]:
    """The line a finished run prints about its cost (nothing when there is no cost)."""
    if cost is None:
        return []
    return [f"cost: {_millions(cost['flops_per_token_forward'])} MFLOPs/token forward, "
            f"{_millions(cost['flops_per_token_training'])} training; achieved {_per_s(cost['achieved_flops_per_s'])}, "
            f"{cost['mfu']:.0%} of a measured {_per_s(cost['peak_flops_per_s'])} {cost['peak_dtype']} matmul peak"]
