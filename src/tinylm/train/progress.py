"""What a training run prints: the header, a progress bar or line per interval, evaluations, the summary
(and draws: its schedule before the first step).

Only process 0 prints (`tinylm.train.loop` passes the others a ``log`` that drops lines). The
text goes through ``log`` (print by default), so a Python caller can collect it; the bar alone
writes to stderr, and only when stderr is a terminal::

    progress = Progress(total=1000, start=0, log=print, enabled=True, bar=stderr_is_terminal())
    progress.update(step, n_steps, loss, lr, tokens_per_s, seconds_left)
    progress.write(eval_line(step, val, shards.num_tokens("val")))
    progress.close()
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from tinylm.config import Config, TrainConfig
from tinylm.data.shards import ShardSet
from tinylm.device import precision_name
from tinylm.evaluate import EvalResult
from tinylm.explain.accounting import summary
from tinylm.explain.plots import plot_schedule
from tinylm.model.lora import LoraSettings, lora_line
from tinylm.model.memory import STEP_BATCH_BYTES_PER_TOKEN, format_bytes, machine_memory
from tinylm.train.schedule import group_lr, long_start, momentum_at


def stderr_is_terminal() -> bool:
    return sys.stderr is not None and sys.stderr.isatty()


def duration(seconds: float) -> str:
    """``m:ss``, or ``h:mm:ss`` from an hour on."""
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


class Progress:
    """A tqdm bar on a terminal; otherwise a plain line every ``log_interval`` steps."""

    def __init__(self, total: int, start: int, log: Callable[[str], None], enabled: bool, bar: bool) -> None:
        self.total, self.log, self.enabled = total, log, enabled
        self.bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True, file=sys.stderr,
                        leave=False) if enabled and bar else None

    def update(self, step: int, n_steps: int, loss: float, lr: float, tok_s: float, left: float) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(n_steps)
            self.bar.set_postfix_str(f"loss {loss:.4f} | {tok_s:,.0f} tok/s | {duration(left)} left", refresh=False)
        else:
            self.log(f"step {step}/{self.total} | loss {loss:.4f} | lr {lr:.2e} | {tok_s:,.0f} tok/s | "
                     f"{duration(left)} left")

    def write(self, text: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.clear()
            self.log(text)
            self.bar.refresh()
        else:
            self.log(text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def eval_line(step: int, val: EvalResult, val_tokens: int) -> str:
    """One evaluation, with what it covered (``val_tokens``: the size of the validation split)."""
    scope = (f"{val.tokens:,} of {val_tokens:,} tokens, bytes prorated" if val.prorated
             else f"the whole validation split, {val.tokens:,} tokens")
    scope += f", {val.describe_windows()}"
    unknown = f"; {val.unknown_tokens:,} <unk> tokens charged 8 bits a byte" if val.unknown_tokens else ""
    return (f"step {step}: val loss {val.loss:.4f}, perplexity {val.perplexity:.2f}, "
            f"{val.bits_per_byte:.4f} bits per byte ({scope}{unknown})")


def header_lines(config: Config, *, out: Any, resuming_at: int | None, shards: ShardSet, total: int, per_step: int,
                 param_groups: Sequence[dict[str, Any]], device: Any, processes: str, threads: int,
                 metrics_where: Sequence[str], threads_line: str | None = None) -> list[str]:
    """The lines a run starts with: what it trains, on what data, for how long, where.

    ``processes``: "1 process" or "W processes (ddp)"; ``metrics_where``: where the metrics go
    (named only when there is more than metrics.jsonl); ``threads_line``: why that many CPU threads
    (`tinylm.device.ThreadChoice.line`: which busy cores were left out).
    """
    mc, tc = config.model, config.train
    verb = f"resuming at step {resuming_at} of" if resuming_at is not None else "training"
    meta, splits, tok = shards.meta, shards.meta["splits"], shards.tokenizer()
    data = (f"data: {meta['corpus']}, {tok.kind} tokenizer |V| = {tok.vocab_size}: "
            f"{splits['train']['tokens']:,} training and {splits['val']['tokens']:,} validation tokens "
            f"({shards.path}{', reused' if shards.reused else ''})")
    lines = [f"tinylm train: {verb} run {out}", data, f"model: {summary(mc)}"]
    lora = LoraSettings.of(tc)
    if lora is not None:
        lines.append(lora_line(mc, lora))
    accum = f" x {tc.grad_accum} micro-batches" if tc.grad_accum > 1 else ""
    decay = f"{tc.decay} to {tc.final_lr:.2e}" if tc.decay != "constant" else "constant"
    if tc.decay == "wsd":
        decay = f"held, then {tc.decay_shape} decay over the last {tc.decay_fraction:.0%} to {tc.final_lr:.2e}"
    rates = ", ".join(f"{g.get('roles', 'all')} {g['peak_lr']:.2e}" for g in param_groups)
    muon = tc.optimizer == "muon" and any("matrix" in g.get("roles", "").split(",") for g in param_groups)
    optimizer = (f"muon (matrices, momentum {tc.muon_momentum:g}) + adamw, lr {rates}" if muon
                 else f"adamw, lr {rates}" if tc.optimizer == "muon"  # nothing Muon would train (a LoRA run)
                 else f"{tc.optimizer} lr {tc.lr:.2e}")
    lines.append(f"training: {total:,} steps of {tc.batch_size}{accum} x {mc.block_size} tokens = {per_step:,} tokens "
                 f"({total * per_step:,} in all), {optimizer}, {tc.warmup_steps} warmup steps, "
                 f"then {decay}; {tc.batch_mode} batches")
    windows = windows_line(tc, mc.block_size, total)
    if windows:
        lines.append(windows)
    if tc.warmup_steps >= total:
        lines.append(f"warning: {tc.warmup_steps} warmup steps for a run of {total:,}: the whole run is warmup (the "
                     f"rate never decays{'' if tc.warmup_steps == total else ' nor reaches its peak'}); "
                     f"set --warmup-steps below {total:,}")
    lines.append(f"device: {device}, {precision_name(device, tc.dtype)}, {processes}, "
                 f"{threads} CPU thread{'s' if threads > 1 else ''} each{', compiled' if tc.compile else ''}")
    if threads_line:
        lines.append(threads_line)
    if len(metrics_where) > 1:  # --log-to: metrics.jsonl and where else they go
        lines.append(f"metrics: {'; '.join(metrics_where)}")
    return lines


def windows_line(tc: TrainConfig, block_size: int, total: int) -> str | None:
    """The sequence-length schedule in words (`tinylm.train.schedule.window_at`), or None when every step trains
    at block_size."""
    start = long_start(tc, total)
    if start == 0 or tc.short_block_size == block_size:
        return None
    rows = tc.batch_size * block_size // tc.short_block_size
    accum = f" x {tc.grad_accum}" if tc.grad_accum > 1 else ""
    if start >= total:
        return (f"windows: every step on {rows}{accum} x {tc.short_block_size} tokens (long_fraction 0: none at "
                f"{block_size})")
    return (f"windows: steps 1-{start:,} on {rows}{accum} x {tc.short_block_size} tokens, the last {total - start:,} "
            f"({tc.long_fraction:.0%}) on {tc.batch_size}{accum} x {block_size}: the same tokens a step")


def out_of_memory_advice(config: Config, device: Any) -> str:
    """What to lower when a step runs out of memory; the advice never asks for more rows per step or more memory.

    A micro-batch's activations grow with batch_size x block_size, so the first lever is a smaller
    batch_size with as many more micro-batches as keep the rows of a step (``batch_size x grad_accum``)
    the same. A step's rows are drawn at once, though: when their token ids are what fills the memory
    (a grad_accum in the millions), it is grad_accum that must come down. With batch_size 1 there is
    no smaller micro-batch: block_size or the model must shrink.
    """
    tc, block_size = config.train, config.model.block_size
    rows = tc.batch_size * tc.grad_accum
    shape = f"batch_size {tc.batch_size}" + (f" x grad_accum {tc.grad_accum}" if tc.grad_accum > 1 else "")
    head = f"out of memory on {device} with {shape} x block_size {block_size}"
    step_ids = rows * block_size * STEP_BATCH_BYTES_PER_TOKEN
    memory = machine_memory()
    if tc.grad_accum > 1 and memory is not None and 2 * step_ids > memory:
        # the most micro-batches whose token ids take at most half the memory, as the test above asks
        fits = max(1, min(tc.grad_accum // 2, memory // (2 * tc.batch_size * block_size * STEP_BATCH_BYTES_PER_TOKEN)))
        return (f"{head}: a step draws all its {rows:,} rows at once, {format_bytes(step_ids)} of token ids on a "
                f"machine of {format_bytes(memory)}; lower grad_accum (--grad-accum {fits} keeps them under half of "
                "it), or block_size")
    if tc.batch_size > 1:
        factor = _smallest_factor(tc.batch_size)
        return (f"{head}: lower batch_size (--batch-size {tc.batch_size // factor} --grad-accum "
                f"{tc.grad_accum * factor} keeps the same {rows:,} rows per step) or block_size, or use a smaller "
                "model")
    return (f"{head}: batch_size is 1 already, so lower block_size (--block-size {max(block_size // 2, 1)}) or use a "
            "smaller model")


def _smallest_factor(n: int) -> int:
    """The smallest divisor of ``n`` above 1 (``n`` > 1): batch_size / it and grad_accum x it keep their product."""
    return next((k for k in range(2, math.isqrt(n) + 1) if n % k == 0), n)


def closing_lines(*, step: int, tokens: int, elapsed: float, latest: Any, best: Any, best_step: int | None,
                  plot: Any) -> list[str]:
    """What a finished run says after its final evaluation: how long, where its checkpoints and curve are."""
    lines = [f"trained {step:,} steps in {duration(elapsed)} ({tokens:,} tokens, "
             f"{tokens / max(elapsed, 1e-9):,.0f} tokens/s overall)",
             f"checkpoint: {latest} (best: {best}, step {best_step})"]
    if plot is not None:
        lines.append(f"loss curve: {plot}")
    return lines


def sample_lines(tc: TrainConfig, sample: str, start: str | None = None) -> list[str]:
    """The closing sample of any family's run, with how it was drawn and, given ``start``, what it started from
    (`tinylm.generate.opening.Opening.describe`); nothing when no sample was asked for."""
    if not tc.sample_tokens:
        return []
    return [f"sample ({tc.sample_tokens} tokens at most, temperature {tc.sample_temperature:g}"
            f"{f', top-k {tc.sample_top_k}' if tc.sample_top_k else ''}"
            f"{f'; starting from {start}' if start else ''}):", sample]


def plot_schedule_of(optimizers: Sequence[Any], tc: TrainConfig, total: int, path: Path, run_name: str) -> Path:
    """schedule.png: every optimizer group's rate at every step of the run (and Muon's momentum), known
    before the first step."""
    # groups of one peak follow one curve (they differ in weight decay, or in optimizer): one label for them all
    by_peak: dict[float, dict[str, list[str]]] = {}
    for opt in optimizers:
        for group in opt.param_groups:
            kinds = by_peak.setdefault(group["peak_lr"], {})
            kinds.setdefault(type(opt).__name__, []).append(group.get("roles", "parameters"))
    rates = {", ".join(f"{','.join(roles)} ({kind})" for kind, roles in kinds.items()) + f", peak {peak:.3g}":
             [group_lr(tc, total, step, peak) for step in range(total)] for peak, kinds in by_peak.items()}
    momentum = None
    if tc.optimizer == "muon" and tc.muon_momentum_warmup:
        momentum = [momentum_at(step, momentum=tc.muon_momentum, warmup=tc.muon_momentum_warmup)
                    for step in range(total)]
    decay = {"wsd": f"warmup-stable-decay ({tc.decay_shape}, last {tc.decay_fraction:.0%})"}.get(tc.decay, tc.decay)
    return plot_schedule(rates, path, momentum=momentum, title=f"{run_name}: {tc.warmup_steps} warmup steps, then {decay}")
