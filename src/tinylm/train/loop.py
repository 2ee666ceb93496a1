"""The training loop: maximum likelihood by mini-batch gradient descent, resumable and reproducible.

One optimizer step, as in nanoGPT, written out::

    lr = lr_at(step)                                   warmup, then the schedule's decay (wsd by default)
    for each of grad_accum micro-batches:              rows of the global batch: a function of (seed, step)
        logits = model(x)                              (B, T, |V|)
        loss = sum_t -log softmax(logits_t)[y_t] / n   n = real targets in the whole step's batch
        loss.backward()                                gradients add up over micro-batches
    clip the gradient's norm to grad_clip
    optimizer.step(); zero the gradients

Dividing every micro-batch's *sum* by the number of targets of the *whole* step (not each
micro-batch's mean by grad_accum) makes the step's gradient exactly the gradient of the mean
loss over the global batch, also when document rows hold different numbers of real tokens, and
also across processes (DDP averages gradients over W processes, so each multiplies by W).

What makes a resumed run end with the same weights as an uninterrupted one:

- the batches of step s depend only on (seed, s) (`tinylm.train.batches`): no reader state;
- the checkpoint holds the weights, the optimizer's moments and step counts, and each process's
  torch random state (dropout), all restored before the next step;
- the learning rate is a function of the step; evaluation runs the model in eval mode and
  draws no random numbers, so whether or not a run paused for it changes nothing.

Non-finite losses: the per-step losses are checked (a single sync, every ``log_interval``
steps) before anything is logged or saved, so a NaN or infinite loss stops the run with the
step that went bad and leaves the last good checkpoint as it was.

Around the loop: what a run starts from (`tinylm.train.start`), what it prints
(`tinylm.train.progress`), what its checkpoints hold (`tinylm.train.state`), where it runs
(`tinylm.device`, `tinylm.train.distributed`). An n-gram run is counted (`tinylm.train.ngram`).

Usage::

    config = resolve_config(preset="tiny", overrides={"max_steps": 200})
    result = train(config, "runs/mine")
    result = train(None, "runs/mine", resume=True)      # after an interruption
"""

from __future__ import annotations

import contextlib
import math
import os
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from tinylm.config import Config
from tinylm.data.chat_shards import chat_opening
from tinylm.data.shards import ShardSet
from tinylm.device import out_of_memory_explained, use_threads
from tinylm.errors import TinyLMError
from tinylm.evaluate import EvalResult, evaluate, evaluate_chats, restrict, window_starts
from tinylm.explain.plots import plot_loss_curve
from tinylm.generate.opening import opening_of_shards
from tinylm.generate.reference import reference_generate
from tinylm.generate.sampling import SamplingParams
from tinylm.lock import folder_lock
from tinylm.model.gpt import IGNORE_INDEX
from tinylm.run import LORA_BASE, METRICS_FILE, PLOT_FILE, SCHEDULE_FILE, Checkpoint, RunResult, checkpoint_path
from tinylm.run import lora_base_record
from tinylm.run import check_new_run_folder, check_same_family, checkpoint_to_resume, clear_run_folder, copy_checkpoint, data_info
from tinylm.run import empty_prompt_ids, read_metrics, run_family, start_ids, update_run_info, write_run_files
from tinylm.train.batches import BatchSource, micro_batches
from tinylm.train.cost import cost_lines, run_cost, write_cost_table
from tinylm.train.distributed import Distributed, gradient_sync
from tinylm.train.metrics_sinks import MetricsLog, check_backends, open_metrics_log
from tinylm.train.moe import MoETraining
from tinylm.train.ngram import count_ngram
from tinylm.train.optim import optimizers_of, set_schedule
from tinylm.train.progress import Progress, closing_lines, eval_line, header_lines, plot_schedule_of, sample_lines
from tinylm.train.progress import out_of_memory_advice, stderr_is_terminal
from tinylm.train.schedule import group_lr, momentum_at, window_at
from tinylm.train.start import already_trained, build_training_model, check_arguments, plan_run, resumed_config
from tinylm.train.start import tokens_per_step
from tinylm.train.state import checkpoint_state, restore, save_training_checkpoint, seed_dropout
from tinylm.train.stopping import StopRequest


class StepOutcome(NamedTuple):
    """What one optimizer step gives back: this process's summed loss, the step's target count, the gradient norm."""

    loss_sum: torch.Tensor
    n_targets: int
    grad_norm: torch.Tensor


class _Pending(NamedTuple):
    """A step done but not yet checked or logged: its loss stays on the device until the next log line
    (one sync per ``log_interval`` steps, not one per step)."""

    step: int
    lr: float
    outcome: StepOutcome


def train(
    config: Config | None,
    out_dir: str | os.PathLike,
    *,
    resume: bool | str = False,
    force: bool = False,
    init_from: str | os.PathLike | None = None,
    stop_after: int | None = None,
    progress: bool | None = None,
    log: Callable[[str], None] = print,
) -> RunResult:
    """Train a model as ``config`` says, in the run folder ``out_dir``; see the module docstring.

    - ``resume``: continue the run in ``out_dir`` from checkpoints/latest (True or "latest"),
      checkpoints/best ("best"), or a checkpoint folder (a path). ``config`` None means the run's
      own; a given one may differ only in `RESUMABLE_CHANGES`.
    - ``force``: start over in an existing run folder, deleting it first. Without it (or
      ``resume``) an existing run folder is an error: nothing is overwritten.
    - ``init_from``: start from the weights of another run (its best checkpoint) or checkpoint
      folder, with a fresh optimizer: fine-tuning. Its tokenizer is used; the model settings
      must match.
    - ``stop_after``: stop after this many steps with a checkpoint, as if interrupted.
    - ``progress``: False hides the progress; otherwise a tqdm bar when stderr is a terminal, a
      line every ``log_interval`` steps when it is not. ``log``: where the lines go (print).

    Under ``torchrun`` every process calls this; process 0 logs and writes.
    """
    out = Path(out_dir)
    check_arguments(config, out, resume, force, init_from)
    if not resume:
        check_new_run_folder(out, force)  # before the lock makes the folder (and again under it, in plan_run)
    # one process writes a run folder at a time (under torchrun, process 0 holds the lock for all)
    locks = int(os.environ.get("RANK", "0")) == 0 and (out.is_dir() or not resume)
    with folder_lock(out, "train") if locks else contextlib.nullcontext():
        return _train(config, out, resume, force, init_from, stop_after, progress, log)


def _train(config: Config | None, out: Path, resume: bool | str, force: bool, init_from: str | os.PathLike | None,
           stop_after: int | None, progress: bool | None, log: Callable[[str], None]) -> RunResult:
    if resume and config is not None:
        check_same_family(config, out)
    if run_family(config, out) == "ngram":  # counting, not gradient descent
        return count_ngram(config or Config(), out, resume=resume, force=force, init_from=init_from, log=log)
    ckpt = checkpoint_to_resume(out, resume) if resume else None
    if ckpt is not None:
        config = resumed_config(config, ckpt, out)
    assert config is not None
    check_backends(config.train.log_backends)  # a missing tensorboard or wandb stops the run before it starts
    ctx = Distributed.from_env(config.train.device)
    clean = False
    try:
        with use_threads(ctx.device, config.train.threads, ctx.local_world_size) as chosen:
            result = _start(config, out, ckpt, ctx, force, init_from, stop_after, progress, log, chosen.line())
        clean = True
        return result
    finally:
        ctx.close(clean)


def _start(config: Config, out: Path, ckpt: Checkpoint | None, ctx: Distributed, force: bool,
           init_from: str | os.PathLike | None, stop_after: int | None, progress: bool | None,
           log: Callable[[str], None], threads_line: str) -> RunResult:
    """Everything the steps need, checked before anything is written (`plan_run`); then the run (`_Trainer`)."""
    log_main: Callable[[str], None] = log if ctx.is_main else (lambda text: None)
    plan = plan_run(config, out, ckpt, ctx, force, init_from, log_main)
    done = already_trained(out, ckpt, plan.total, log_main)
    if done is not None:
        return done
    trainer = _Trainer(plan.config, out, plan.shards, plan.total, ctx, ckpt=ckpt, init=plan.init, force=force,
                       stop_after=stop_after, progress=progress, log=log_main)
    try:
        if plan.extension:
            log_main(plan.extension)
        trainer.log_header(threads_line)
        with out_of_memory_explained(out_of_memory_advice(plan.config, ctx.device)):
            return trainer.run()
    finally:
        trainer.metrics.close()


class _Trainer:
    """One training run once its data and configuration are settled: the model, the steps, evaluation,
    checkpoints and the end. Making one builds the model and writes the run folder's files."""

    def __init__(self, config: Config, out: Path, shards: ShardSet, total: int, ctx: Distributed, *,
                 ckpt: Checkpoint | None, init: Checkpoint | None, force: bool, stop_after: int | None,
                 progress: bool | None, log: Callable[[str], None]) -> None:
        self.config, self.tc, self.out, self.ctx, self.ckpt = config, config.train, out, ctx, ckpt
        self.shards, self.tokenizer, self.total = shards, shards.tokenizer(), total
        self.device = ctx.device
        self.stop_after = stop_after
        self.log_main = log
        self.progress_enabled = ctx.is_main and progress is not False
        self.show_bar = self.progress_enabled and stderr_is_terminal()
        mc, tc = config.model, config.train
        self.source = BatchSource(shards, mode=tc.batch_mode, batch_size=tc.batch_size, block_size=mc.block_size,
                                  seed=tc.seed, bos_id=self.tokenizer.bos_id, pad_id=self.tokenizer.pad_id,
                                  pack=mc.family == "gpt")

        # the model, its optimizer, and how each step calls it
        built = build_training_model(config, ctx, init, ckpt)
        self.model, self.step_model, self.eval_model, self.ddp = built.model, built.step_model, built.eval_model, built.ddp
        self.optimizer, self.fsdp, self.autocast = built.optimizer, built.sharded, built.autocast
        self.head_in_slices = built.head_in_slices
        self.lora_base = built.lora_base  # a LoRA run's base: its checkpoints name it
        self.moe = MoETraining(self.model, mc, ctx)  # a Mixture of Experts' losses, bias updates and loads

        # where the run stands: fresh, or as the checkpoint left it (its optimizer, random state and counts)
        state = ckpt.state if ckpt is not None else {}
        self.step: int = ckpt.step if ckpt is not None else 0
        self.tokens = int(state.get("tokens", 0))
        self.elapsed_before = float(state.get("elapsed", 0.0))  # seconds of training in earlier sessions of this run
        self.best_val_loss = float(state.get("best_val_loss") or math.inf)
        self.best_step: int | None = state.get("best_step")
        self.saved_step: int | None = ckpt.step if ckpt is not None else None  # the step checkpoints/latest holds
        self.last_loss: float | None = None  # the mean training loss of the last logged steps
        if ckpt is not None:
            restore(ckpt, self.model, self.optimizer, ctx, sharded=self.fsdp, seed=tc.seed)
        else:
            seed_dropout(tc.seed, ctx.rank)
        self.started = time.perf_counter()  # reset when the first step starts
        self.step_inputs = 0  # the tokens the last step read (`_train_step`)

        ctx.main_first(lambda: self._write_run_files(force))
        # process 0 logs the metrics; it opens the backends once the run folder is ready (--force cleared)
        self.metrics = open_metrics_log(config, out, self.step) if ctx.is_main else MetricsLog([])

    def _write_run_files(self, force: bool) -> None:
        if self.ckpt is None and force:
            kept = clear_run_folder(self.out, keep=self.shards.path)
            if kept:
                self.log_main(f"--force replaced the run in {self.out}; kept what is not tinylm's: {', '.join(kept)}")
        write_run_files(self.out, self.config, self.tokenizer, metrics_up_to=self.step, info={
            "status": "running", "family": self.config.model.family, "step": self.step, "total_steps": self.total,
            "data": data_info(self.shards)})
        plot_schedule_of(optimizers_of(self.optimizer), self.tc, self.total, self.out / SCHEDULE_FILE, self.out.name)
        write_cost_table(self.out, self.config, self.model)

    def log_header(self, threads_line: str) -> None:
        processes = f"{self.ctx.world_size} processes ({self.tc.parallel})" if self.ctx.active else "1 process"
        for line in header_lines(self.config, out=self.out, resuming_at=self.step if self.ckpt is not None else None,
                                 shards=self.shards, total=self.total, per_step=tokens_per_step(self.config),
                                 param_groups=self.optimizer.param_groups, device=self.device, processes=processes,
                                 threads=torch.get_num_threads(), metrics_where=self.metrics.where,
                                 threads_line=threads_line):
            self.log_main(line)

    # -- the steps

    def _train_step(self, step: int) -> StepOutcome:
        """One optimizer step; returns this process's summed loss, the step's target count, the gradient norm."""
        tc, W = self.tc, self.ctx.world_size
        # the whole step's batch is drawn in every process (only token ids: cheap), so all agree on
        # the number of targets; each then computes on its own rows. A short step of the sequence-length
        # schedule (and packed conversations in rows shorter than block_size) has k = block_size / window
        # times as many rows, k * batch_size a micro-batch.
        window = window_at(tc, self.config.model.block_size, self.total, step)
        batch = self.source.step_batch(step, tc.grad_accum, window)
        n_targets = batch.n_targets
        if n_targets == 0:
            raise TinyLMError(f"step {step + 1} has no targets to learn from; check the data")
        micro = micro_batches(batch, len(batch.x) // tc.grad_accum, self.ctx.rank, W)
        loss_sum = torch.zeros((), device=self.device)
        for i, mb in enumerate(micro):
            inputs = mb.to(self.device)  # idx, targets, and the padding mask or segment ids where there are some
            y = inputs.pop("targets")
            last = i == tc.grad_accum - 1
            with gradient_sync(self.model, self.ddp, self.fsdp, sync=last):
                if self.head_in_slices:
                    with self.autocast():
                        _, nll = self.step_model(**inputs, targets=y, reduction="sum", return_logits=False)
                else:
                    with self.autocast():
                        logits, _ = self.step_model(**inputs)  # (B, T, |V|)
                    nll = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=IGNORE_INDEX,
                                          reduction="sum")
                loss = nll * (W / n_targets)  # DDP divides by W when it averages gradients
                balance = self.moe.penalty(tc.grad_accum)  # MoE: the load-balancing and z losses
                (loss if balance is None else loss + balance).backward()
            loss_sum += nll.detach()
        params = [p for p in self.model.parameters() if p.grad is not None]
        if tc.grad_clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(params, tc.grad_clip)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        if hasattr(norm, "full_tensor"):  # a sharded model's norm is a distributed tensor
            norm = norm.full_tensor()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.moe.after_step()  # MoE: the experts' loads over all processes, the selection biases moved
        self.step_inputs = batch.n_inputs  # the tokens the step read, padding left out
        return StepOutcome(loss_sum, n_targets, norm.detach())

    def _check(self, pending: list[_Pending]) -> list[float]:
        """The global mean loss of each pending step; stops the run at the first non-finite one."""
        sums = self.ctx.all_reduce_sum(torch.stack([p.outcome.loss_sum for p in pending]).double())
        norms = torch.stack([p.outcome.grad_norm.float() for p in pending]).cpu()
        losses = [float(s) / p.outcome.n_targets for s, p in zip(sums.cpu(), pending)]
        for p, loss, norm in zip(pending, losses, norms.tolist()):
            if not (math.isfinite(loss) and math.isfinite(norm)):
                what = (f"the training loss became {loss}" if not math.isfinite(loss)
                        else f"the gradient norm became {norm}")
                latest = checkpoint_path(self.out, "latest")
                kept = (f"the last good checkpoint, {latest} (step {self.saved_step}), is kept"
                        if self.saved_step is not None else "no checkpoint had been saved yet")
                raise TinyLMError(
                    f"{what} at step {p.step + 1} (lr {p.lr:.3g}); stopped without saving it: {kept}. Lower lr (now "
                    f"{self.tc.lr:g}), keep grad_clip on, then start again with --force "
                    "(or --resume from the checkpoint)"
                )
        return losses

    def run(self) -> RunResult:
        """Step until the budget (or ``stop_after``, or a signal) is reached, evaluating, logging and saving on the
        way; then the final evaluation and sample, or a stop with a checkpoint of the step reached."""
        stop = self.total if self.stop_after is None else min(self.total, max(self.stop_after, self.step))
        progress = Progress(self.total, self.step, self.log_main, self.progress_enabled, self.show_bar)
        self.started = time.perf_counter()
        self.model.train()
        signalled = StopRequest()
        try:
            with signalled:
                self._steps(stop, progress, signalled)
        except KeyboardInterrupt:
            # a second signal: stopped at once, keeping the last checkpoint written
            if self.ctx.is_main and self.saved_step is not None:
                update_run_info(self.out, status="stopped", step=self.saved_step)
            raise
        finally:
            progress.close()
        if self.step < self.total:
            self._update_run_info("stopped", self.last_loss)
            how = f"stopped by {signalled.name}" if signalled.requested() else "stopped"
            self.log_main(f"{how} after step {self.step} of {self.total}, with a checkpoint of that step in "
                          f"{checkpoint_path(self.out, 'latest')}; continue with --resume")
            result = self._result("stopped", self.last_loss, None, "")
            result.stopped_by = signalled.signum
            return result
        return self._finish(self.last_loss)

    def _steps(self, stop: int, progress: Progress, signalled: StopRequest) -> None:
        """The steps up to ``stop``, or up to the end of the step a stop signal came in."""
        tc = self.tc
        ckpt_every = tc.checkpoint_interval or tc.eval_interval
        per_step = tokens_per_step(self.config)
        agree = (lambda flag: self.ctx.all_reduce_sum(flag.to(self.device)).cpu()) if self.ctx.active else None
        pending: list[_Pending] = []
        window_start, window_tokens = time.perf_counter(), 0
        while self.step < stop:
            step = self.step
            lr = self._lr(step, tc.lr)
            set_schedule(self.optimizer, lambda peak: self._lr(step, peak),
                         momentum_at(step, momentum=tc.muon_momentum, warmup=tc.muon_momentum_warmup))
            pending.append(_Pending(step, lr, StepOutcome(*self._train_step(step))))
            self.step += 1
            read = self.step_inputs if tc.batch_mode == "chats" else per_step  # chats: what was read, not padding
            self.tokens += read
            window_tokens += read
            done = self.step
            by_signal = signalled.requested(agree)
            if by_signal:
                stop = done  # this step is done: save it and stop (without evaluating: the user is waiting)
            do_eval = done % tc.eval_interval == 0 and done < self.total and not by_signal
            do_save = done % ckpt_every == 0 or done == stop
            if done % tc.log_interval == 0 or do_eval or do_save or done == self.total:
                losses = self._check(pending)
                now = time.perf_counter()
                tok_s = window_tokens / max(now - window_start, 1e-9)
                self.last_loss = sum(losses) / len(losses)
                rate = (now - self.started) / max(done - (self.ckpt.step if self.ckpt else 0), 1)
                left = rate * (self.total - done)
                self.metrics.log({"kind": "train", "step": done, "loss": self.last_loss, "lr": lr,
                                  "tokens": self.tokens, "tokens_per_s": tok_s,
                                  "grad_norm": float(pending[-1].outcome.grad_norm), "elapsed": self._elapsed(),
                                  **self.moe.metrics()})
                for line in self.moe.warnings():  # a collapsed MoE layer: said even when the progress is hidden
                    (progress.write if progress.enabled else self.log_main)(line)
                progress.update(done, len(pending), self.last_loss, lr, tok_s, left)
                pending, window_start, window_tokens = [], now, 0
            improved = False
            if do_eval:
                val = self._evaluate(tc.eval_tokens)
                progress.write(eval_line(done, val, self.shards.num_tokens("val")))
                self.metrics.log({"kind": "eval", "step": done, **val.as_dict(), "elapsed": self._elapsed()})
                improved = self._note_val_loss(val.loss)
            if do_save and done < self.total:
                self._save_latest()
            if improved:
                self._save_best(saved_now=do_save and done < self.total)
            if do_eval or do_save:
                window_start = time.perf_counter()  # evaluating and saving are not training speed

    def _lr(self, step: int, peak: float) -> float:
        return group_lr(self.tc, self.total, step, peak)

    # -- evaluation, checkpoints, the end

    def _evaluate(self, max_tokens: int) -> EvalResult:
        # On a CPU, evaluation stays in float32 whatever training runs in: it is a small part of the
        # time, and the figure printed is then the one `tinylm eval` gives for the same weights.
        autocast = self.autocast if self.device.type != "cpu" else contextlib.nullcontext
        if self.tc.batch_mode == "chats":  # the loss on what the assistant writes in the held-out chats
            return evaluate_chats(self.eval_model, self.shards, "val", block_size=self.config.model.block_size,
                                  batch_size=self.tc.eval_batch_size or self.tc.batch_size, device=self.device,
                                  autocast=autocast)
        return evaluate(self.eval_model, self.shards, "val", block_size=self.config.model.block_size,
                        batch_size=self.tc.eval_batch_size or self.tc.batch_size, max_tokens=max_tokens,
                        device=self.device, autocast=autocast, rank=self.ctx.rank,
                        world_size=self.ctx.world_size)

    def _elapsed(self) -> float:
        return self.elapsed_before + time.perf_counter() - self.started

    def _save(self, name: str) -> None:
        state = checkpoint_state(self.tc, step=self.step, total=self.total, tokens=self.tokens, elapsed=self._elapsed(),
                                 best_val_loss=self.best_val_loss, best_step=self.best_step,
                                 world_size=self.ctx.world_size)
        if self.lora_base is not None:
            state[LORA_BASE] = lora_base_record(self.lora_base, checkpoint_path(self.out, name))
        save_training_checkpoint(checkpoint_path(self.out, name), self.model, self.optimizer, self.ctx,
                                 sharded=self.fsdp, config=self.config, tokenizer=self.tokenizer, state=state)

    def _save_latest(self) -> None:
        self._save("latest")
        self.saved_step = self.step
        self._update_run_info("running", None)

    def _note_val_loss(self, val_loss: float) -> bool:
        """Whether ``val_loss`` is the best yet (and if so, remember it before any checkpoint is written)."""
        if not val_loss < self.best_val_loss:
            return False
        self.best_val_loss, self.best_step = val_loss, self.step
        return True

    def _save_best(self, saved_now: bool) -> None:
        if saved_now:  # the same weights are in latest already: copy its files
            if self.ctx.is_main:
                copy_checkpoint(checkpoint_path(self.out, "latest"), checkpoint_path(self.out, "best"))
            self.ctx.barrier()
        else:
            self._save("best")

    def _update_run_info(self, status: str, train_loss: float | None, **extra: Any) -> None:
        if self.ctx.is_main:
            loss = {"train_loss": train_loss} if train_loss is not None else {}
            update_run_info(self.out, status=status, step=self.step, total_steps=self.total, **extra, **loss)

    def _finish(self, last_loss: float | None) -> RunResult:
        tc, out = self.tc, self.out
        final = self._evaluate(tc.final_eval_tokens)
        # the best checkpoint is chosen on the same windows as every periodic evaluation
        n_val = self.shards.num_tokens("val")
        periodic = window_starts(n_val, self.config.model.block_size, tc.eval_tokens)
        if tc.batch_mode == "chats":  # every evaluation scores every held-out chat
            comparable = final
        elif np.isin(periodic, final.window_starts).all():
            comparable = restrict(final, periodic, n_val, self.shards.meta["splits"]["val"]["bytes"])
        else:
            comparable = self._evaluate(tc.eval_tokens)
        self.metrics.log({"kind": "eval", "step": self.step, **comparable.as_dict(), "elapsed": self._elapsed()})
        self.metrics.log({"kind": "final", "step": self.step, **final.as_dict(), "elapsed": self._elapsed()})
        improved = self._note_val_loss(comparable.loss)
        self._save_latest()
        if improved:
            self._save_best(saved_now=True)
        plot = None
        if self.ctx.is_main:
            plot = plot_loss_curve(read_metrics(out / METRICS_FILE), out / PLOT_FILE,
                                   title=f"{out.name}: {final.bits_per_byte:.3f} bits per byte on validation")
        sample, start = self._sample()
        cost = run_cost(out, self.config, self.device, self.ctx.world_size) if self.ctx.is_main else None
        val = {"loss": final.loss, "perplexity": final.perplexity, "bits_per_byte": final.bits_per_byte,
               "tokens": final.tokens, "prorated": final.prorated}
        self._update_run_info("complete", last_loss, final=val, sample=sample, elapsed=self._elapsed(),
                              best_step=self.best_step, cost=cost)
        lines = [eval_line(self.step, final, self.shards.num_tokens("val")),
                 *closing_lines(step=self.step, tokens=self.tokens, elapsed=self._elapsed(),
                                latest=checkpoint_path(out, "latest"), best=checkpoint_path(out, "best"),
                                best_step=self.best_step, plot=plot),
                 *cost_lines(cost), *sample_lines(tc, sample, start)]
        for line in lines:
            self.log_main(line)
        result = self._result("complete", last_loss, val, sample)
        result.plot = plot
        return result

    def _sample(self) -> tuple[str, str]:
        """The closing sample (its opening line included) and what it started from: a line drawn from the
        validation split by the run's seed (`tinylm.generate.opening`), so that it shows the text the model
        writes rather than the title page a new document opens with."""
        tc = self.tc
        if not tc.sample_tokens:
            return "", ""
        if tc.batch_mode == "chats":
            return self._chat_sample()
        opening = opening_of_shards(self.shards, tc.seed)
        prompt = (start_ids(self.config, self.tokenizer) + self.tokenizer.encode(opening.text) if opening.text
                  else empty_prompt_ids(self.config, self.tokenizer))
        # every process samples (a sharded model needs all of them for each forward pass); the same
        # seed gives each the same text
        params = SamplingParams(max_new_tokens=tc.sample_tokens, temperature=tc.sample_temperature,
                                top_k=tc.sample_top_k or None, seed=tc.seed)
        model = self.eval_model if self.fsdp else self.model
        with warnings.catch_warnings():  # a sample longer than the context slides its window; expected here
            warnings.simplefilter("ignore", UserWarning)
            (completion,) = reference_generate(model, [prompt], params, self.tokenizer)
        return opening.text + completion.text, opening.describe()

    def _chat_sample(self) -> tuple[str, str]:
        """A fine-tuned model's greedy reply to the first held-out chat, the chat as its template writes it before."""
        prompt = chat_opening(self.shards)
        params = SamplingParams(max_new_tokens=min(self.tc.sample_tokens, self.config.model.block_size - len(prompt)),
                                temperature=0.0)
        model = self.eval_model if self.fsdp else self.model
        (completion,) = reference_generate(model, [prompt], params, self.tokenizer)
        return self.tokenizer.decode(prompt) + completion.text, "the first held-out chat, greedy"

    def _result(self, status: str, train_loss: float | None, val: dict[str, Any] | None, sample: str) -> RunResult:
        return RunResult.of_folder(self.out, status, self.step, self.total, self.tokens, train_loss, val, sample,
                                   self._elapsed())

