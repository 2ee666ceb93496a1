"""What a training run starts from: its budget, the configuration it may resume with, the weights and data.

`tinylm.train.loop.train` calls `plan_run` before its first step; it and the checks it calls
refuse a mistake in one line before anything is written (`already_trained`: nothing left to do):

- `total_steps`: the budget in optimizer steps (``max_steps``, or ``max_tokens`` in whole steps).
- `resumed_config`: a resumed run keeps its own settings, except `RESUMABLE_CHANGES` and a
  larger budget (`extension_note` says what a larger budget does to the schedule).
- `checkpoint_to_init_from`: ``--init-from``, a run's best checkpoint or a checkpoint folder;
  `check_init_fits` then checks it is the same network.
- `build_training_model`: the network seeded, loaded, placed, wrapped, and its optimizer.
- `run_data`: the shards, prepared by process 0 while the others wait, and checked against the
  text and tokenizer a resumed run was trained on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from tinylm.config import Config, TrainConfig
from tinylm.data.chat_shards import is_chats
from tinylm.data.prepare_run import prepare_data
from tinylm.data.shards import ShardSet
from tinylm.device import autocast_for
from tinylm.errors import TinyLMError
from tinylm.model import build_model
from tinylm.model.gpt import GPT
from tinylm.model.lora import LoraMemory, LoraSettings, add_lora, load_adapter, prepare_training
from tinylm.model.memory import check_fits
from tinylm.run import (
    CONFIG_FILE,
    MODEL_FILE,
    RUN_FILE,
    Checkpoint,
    RunResult,
    check_new_run_folder,
    checkpoint_path,
    has_checkpoint,
    load_checkpoint,
    load_weights,
    read_run_info,
    run_family,
)
from tinylm.tokenizers.base import Tokenizer, check_same_tokenizer, load_tokenizer
from tinylm.train.distributed import Distributed, wrap_model
from tinylm.train.optim import make_optimizer
from tinylm.train.schedule import group_lr, window_at

# [train] settings that may differ when a run is resumed: they change what is logged, where it
# runs and how fast, never which batches are drawn or how the weights are updated.
RESUMABLE_CHANGES = frozenset({
    "tokenizer",  # checked by fingerprint instead: the same tokenizer in another file is fine
    "data_dir", "eval_interval", "eval_tokens", "final_eval_tokens", "eval_batch_size", "checkpoint_interval",
    "log_interval", "device", "dtype", "compile", "threads", "parallel",
    "sample_tokens", "sample_temperature", "sample_top_k", "log_to", "wandb_project", "wandb_mode",
})
# The budget may grow on resume (extending a run); `extension_note` says what that does to the schedule.
BUDGET_SETTINGS = frozenset({"max_steps", "max_tokens"})


def check_arguments(config: Config | None, out: Path, resume: bool | str, force: bool,
                    init_from: str | os.PathLike | None) -> None:
    """The combinations `train` refuses before it reads anything."""
    if config is None and not resume:
        raise TinyLMError("a configuration is needed to start a run (only resume can take the run's own)")
    if resume and force:
        raise TinyLMError("--resume continues a run and --force deletes it; choose one")
    if resume and init_from is not None:
        raise TinyLMError("--resume continues a run from its own checkpoint; --init-from starts a new one: choose one")
    data_dir = (config.train.data_dir if config is not None else None)
    if data_dir is not None and Path(data_dir).resolve() == out.resolve():
        raise TinyLMError(f"--data-dir and --out are the same folder ({out}); keep the shards apart from the run "
                          "(e.g. --data-dir data/NAME)")


def tokens_per_step(config: Config) -> int:
    """Training tokens one optimizer step sees: batch_size * grad_accum * block_size."""
    return config.train.batch_size * config.train.grad_accum * config.model.block_size


def total_steps(config: Config) -> int:
    """The number of optimizer steps: max_steps, or max_tokens in whole steps, whichever is smaller."""
    tc = config.train
    budgets = []
    if tc.max_steps is not None:
        budgets.append(tc.max_steps)
    if tc.max_tokens is not None:
        budgets.append(math.ceil(tc.max_tokens / tokens_per_step(config)))
    if not budgets:
        raise TinyLMError("no training budget: set max_steps or max_tokens (e.g. --max-steps 1000)")
    return min(budgets)


def config_differences(old: Config, new: Config, allowed: frozenset[str] = frozenset()) -> list[str]:
    """"[table] key: old -> new" for every setting that differs, except the [train] keys in ``allowed``."""
    out = []
    for section in ("model", "train"):
        a, b = dataclasses.asdict(getattr(old, section)), dataclasses.asdict(getattr(new, section))
        for key in a:
            if a[key] != b[key] and not (section == "train" and key in allowed):
                out.append(f"[{section}] {key}: {a[key]!r} -> {b[key]!r}")
    return out


def resumed_config(config: Config | None, ckpt: Checkpoint, out: Path) -> Config:
    """The configuration to resume ``ckpt`` with: its own (``config`` None), or ``config`` if it differs
    only in `RESUMABLE_CHANGES` and the budget."""
    if config is None:
        return ckpt.config
    # the vocabulary size is the tokenizer's, whatever the preset's placeholder says
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, vocab_size=ckpt.config.model.vocab_size))
    diffs = config_differences(ckpt.config, config, RESUMABLE_CHANGES | BUDGET_SETTINGS)
    if diffs:
        raise TinyLMError(
            f"{ckpt.path} was trained with another configuration ({'; '.join(diffs[:3])}); resume with "
            f"the run's own settings (drop those flags), or start a new run with --out (or --init-from {out})"
        )
    return config


def extension_note(ckpt: Checkpoint, tc: TrainConfig, total: int, out: Path) -> str | None:
    """What resuming with another budget does: None if the budget is the run's own, else a line to log.

    The steps done keep the rates they had. If the longer schedule gives them the same rates (a
    warmup-stable-decay run extended before its decay and its long windows, a constant rate), the run continues
    bitwise as if the new budget had been asked for from the start; if not (a cosine stretched,
    a decay already begun), the line says from which step the schedules part.
    """
    done, before = ckpt.step, total_steps(ckpt.config)
    if before == total:
        return None
    if total < done:
        raise TinyLMError(f"{out} has already trained {done:,} steps, more than the {total:,} this budget "
                          f"gives; ask for more than {done:,} steps (or the tokens of them) to extend it")
    old_tc, block_size = ckpt.config.train, ckpt.config.model.block_size
    old = [group_lr(old_tc, before, step, old_tc.lr) for step in range(done)]
    new = [group_lr(tc, total, step, tc.lr) for step in range(done)]
    parted = next((step for step in range(done) if old[step] != new[step]), None)
    # the sequence-length schedule's long steps move with the budget too (`window_at`)
    windows = next((step for step in range(done) if window_at(old_tc, block_size, before, step)
                    != window_at(tc, block_size, total, step)), None)
    head = f"extending the run from {before:,} to {total:,} steps ({done:,} done)"
    long = ("" if windows is None else f"; the steps done from step {windows:,} on trained on windows of "
            f"{block_size} where a {total:,}-step run trains on {tc.short_block_size}")
    if parted is None:
        if windows is not None:
            return f"{head}: the long windows start later in the longer run{long}; the rest follow the new schedule"
        return (f"{head}: the steps done had the learning rates a {total:,}-step run gives them, so it "
                f"continues as if {total:,} steps had been asked for from the start")
    return (f"{head}: the {tc.decay} schedule is stretched over the new length, so the steps done from step "
            f"{parted:,} on had other learning rates than a {total:,}-step run gives them (step {done - 1:,}: "
            f"{old[done - 1]:.3g}, now {new[done - 1]:.3g}){long}; the rest follow the new schedule")


def checkpoint_to_init_from(init_from: str | os.PathLike | None, tc: TrainConfig) -> Checkpoint | None:
    """The checkpoint ``--init-from`` names (a run's best, else its latest, or a checkpoint folder), or None."""
    if init_from is None:
        return None
    path = Path(init_from)
    if (path / CONFIG_FILE).is_file() and run_family(None, path) == "ngram":
        raise TinyLMError(f"{path} is an n-gram run: it has counts, not weights a network can start from; "
                          "give --init-from a run of the same family")
    if (path / RUN_FILE).exists():  # a run folder: its best checkpoint, or its latest if it has none
        best = checkpoint_path(path, "best")
        path = best if has_checkpoint(best) else checkpoint_path(path, "latest")
    init = load_checkpoint(path)
    if tc.tokenizer is not None:
        check_same_tokenizer(load_tokenizer(tc.tokenizer), init.tokenizer,
                             f"the tokenizer {tc.tokenizer} does not match the one {init.path} was trained with",
                             "drop --tokenizer to use the checkpoint's")
    return init


def check_init_fits(init: Checkpoint, config: Config) -> None:
    """``--init-from``'s network is the one ``config`` builds, except that dropout and bptt may change for
    fine-tuning (truncated BPTT changes how gradients flow, not the weights)."""
    same_family = init.config.model.family == config.model.family
    theirs = dataclasses.replace(init.config.model, dropout=config.model.dropout,
                                 bptt=config.model.bptt if same_family else init.config.model.bptt)
    diffs = config_differences(Config(theirs, config.train), config)
    if diffs:
        raise TinyLMError(f"--init-from {init.path}: that checkpoint is of another model "
                          f"({'; '.join(diffs[:3])}); use its [model] settings")


def run_data(tc: TrainConfig, tokenizer: Tokenizer | None, ckpt: Checkpoint | None, out: Path, ctx: Distributed,
             log: Callable[[str], None]) -> ShardSet:
    """The shards the run reads, prepared by process 0 (see `prepare_data`); ``tokenizer``: the one given by
    the checkpoint resumed (``ckpt``) or started from, if any."""
    if ckpt is not None and tc.tokenizer is not None:
        check_same_tokenizer(load_tokenizer(tc.tokenizer), ckpt.tokenizer,
                             f"the tokenizer {tc.tokenizer} does not match the one this run was trained with",
                             "resume without --tokenizer")
    if tc.batch_mode == "chats":  # conversations `tinylm finetune` wrote: no corpus to prepare
        return chat_data(tc, tokenizer)
    reuse_only = False
    if ckpt is not None and tc.data_dir is None and (out / RUN_FILE).exists():
        # resume from the folder the run trained on, wherever the default would be now; but
        # run.json only names it, so it is read and never written (a user's --data-dir may be)
        recorded = read_run_info(out).get("data", {}).get("dir")
        if isinstance(recorded, str) and recorded and Path(recorded).is_dir():
            tc, reuse_only = dataclasses.replace(tc, data_dir=recorded), True
    prepared = ctx.main_first(lambda: prepare_data(tc, tokenizer, log, reuse_only=reuse_only))
    data_dir = ctx.agree(str(prepared.path) if prepared is not None else None)
    shards = prepared if prepared is not None else ShardSet.open(data_dir)
    if ckpt is not None:
        recorded = read_run_info(out).get("data", {}) if (out / RUN_FILE).exists() else {}
        if recorded.get("input_fingerprint") not in (None, shards.meta["input_fingerprint"]):
            raise TinyLMError(f"the text in {data_dir} is not the text this run was trained on (the corpus "
                              "changed); resume with the same corpus, or start a new run")
    return shards


def chat_data(tc: TrainConfig, tokenizer: Tokenizer | None) -> ShardSet:
    """The conversation shards of a fine-tuning run (``batch_mode = "chats"``), made with its tokenizer."""
    if tc.data_dir is None or not (Path(tc.data_dir) / "meta.json").is_file():
        raise TinyLMError("batch_mode chats reads conversation shards from --data-dir; `tinylm finetune` makes them")
    shards = ShardSet.open(tc.data_dir)
    if not is_chats(shards):
        raise TinyLMError(f"{tc.data_dir} holds text shards, not conversations; `tinylm finetune` makes those")
    if tokenizer is not None:
        check_same_tokenizer(shards.tokenizer(), tokenizer, f"the conversations in {tc.data_dir} were tokenized with "
                             "another tokenizer than the model's", "make them again with `tinylm finetune`")
    return shards


@dataclass
class RunPlan:
    """What `plan_run` settled: the configuration (vocab_size the tokenizer's), data, budget, starting weights."""

    config: Config
    shards: ShardSet
    total: int  # optimizer steps in the whole run
    init: Checkpoint | None  # --init-from's checkpoint
    extension: str | None  # what a larger budget on resume does to the schedule (`extension_note`)


def plan_run(config: Config, out: Path, ckpt: Checkpoint | None, ctx: Distributed, force: bool,
             init_from: str | os.PathLike | None, log: Callable[[str], None]) -> RunPlan:
    """Check everything a run needs and prepare its data, before anything in ``out`` is written or deleted."""
    # sizes from flags, a TOML file or a checkpoint that cannot fit are refused before any data work; vocab_size
    # is the configuration's until the tokenizer is known, and checked again with the tokenizer's below
    sharded_among = ctx.world_size if ctx.active and config.train.parallel == "fsdp" else 1
    check_fits(config.model, config.train, ctx.device, shards=sharded_among)
    init = checkpoint_to_init_from(init_from, config.train)
    check_lora(config, init, ckpt, ctx)
    if ckpt is None:
        ctx.main_first(lambda: check_new_run_folder(out, force))
    elif ckpt.state.get("world_size", 1) != ctx.world_size:
        log(f"note: resuming with {ctx.world_size} processes where the checkpoint had "
            f"{ckpt.state.get('world_size', 1)}; the global batch is the same, but dropout draws "
            "of new processes start fresh")
    given_tokenizer = (ckpt or init).tokenizer if (ckpt or init) is not None else None
    shards = run_data(config.train, given_tokenizer, ckpt, out, ctx, log)
    tokenizer = shards.tokenizer()
    if given_tokenizer is not None:  # prepare_data checks this first; here only as the last guard before training
        check_same_tokenizer(tokenizer, given_tokenizer, "the data folder's tokenizer does not match the checkpoint's",
                             "set --data-dir to another folder")
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, vocab_size=tokenizer.vocab_size))
    check_fits(config.model, config.train, ctx.device, shards=sharded_among)
    if init is not None:
        check_init_fits(init, config)
    total = total_steps(config)
    W = ctx.world_size
    if config.train.batch_size % W:
        raise TinyLMError(f"batch_size {config.train.batch_size} must divide evenly among {W} processes; "
                          f"use a multiple of {W}")
    extension = extension_note(ckpt, config.train, total, out) if ckpt is not None else None
    return RunPlan(config, shards, total, init, extension)


def check_lora(config: Config, init: Checkpoint | None, ckpt: Checkpoint | None, ctx: Distributed) -> None:
    """A LoRA run (``lora_rank``) adapts a trained Transformer: refuse one without a model to adapt, a resumed run
    that changed between adapter and whole-model training, and the combinations it does not take."""
    lora = config.train.lora_rank
    if ckpt is not None and ckpt.is_adapter != bool(lora):
        raise TinyLMError(f"{ckpt.path} was trained {'with' if ckpt.is_adapter else 'without'} LoRA; resume it "
                          "with its own lora settings")
    if not lora:
        return
    if config.model.family != "gpt":
        raise TinyLMError(f"LoRA (lora_rank = {lora}) adapts a Transformer's matrices; a {config.model.family} "
                          "model is fine-tuned whole: set lora_rank = 0")
    if config.model.moe_experts:
        raise TinyLMError(f"LoRA (lora_rank = {lora}) does not adapt a Mixture of Experts' experts in this tinylm; "
                          "fine-tune the MoE model whole: set lora_rank = 0")
    if ckpt is None and init is None:
        raise TinyLMError("LoRA (lora_rank) trains an adapter on a model that is already trained: give it one with "
                          "--init-from RUN (tinylm finetune --from RUN does)")
    if ctx.active and config.train.parallel == "fsdp":
        raise TinyLMError("LoRA's frozen base is not sharded by this tinylm: use --parallel ddp (every process "
                          "keeps the base once, the adapter is small)")


def already_trained(out: Path, ckpt: Checkpoint | None, total: int, log: Callable[[str], None]) -> RunResult | None:
    """The result of the run in ``out`` if resuming it has nothing left to do (it completed ``total`` steps)."""
    if ckpt is None or ckpt.step < total or not (out / RUN_FILE).exists():
        return None
    info = read_run_info(out)
    if info.get("status") != "complete":
        return None
    log(f"{out} is already trained: {ckpt.step} of {total} steps")
    return RunResult.of_folder(out, "complete", ckpt.step, total, int(ckpt.state.get("tokens", 0)),
                               info.get("train_loss"), info.get("final"), info.get("sample", ""),
                               float(info.get("elapsed", 0.0)))


def read_tensor(path: Path, name: str) -> torch.Tensor:
    """The tensor ``name`` of the safetensors file ``path``, alone: a LoRA run reads its base's frozen matrices
    back in full precision this way when it evaluates in float32 (`tinylm.model.lora.LoraMemory`)."""
    with safe_open(path, framework="pt") as f:
        return f.get_tensor(name)


@dataclass
class TrainingModel:
    """The network as training calls it (`build_training_model`)."""

    model: torch.nn.Module  # the network itself (a sharded one is sharded in place)
    step_model: torch.nn.Module  # what a training step calls: wrapped in DDP, compiled
    eval_model: torch.nn.Module  # what evaluation and sampling call: without DDP's gradient hooks
    ddp: torch.nn.Module | None  # the DDP wrapper, for no_sync during accumulation
    optimizer: Any
    sharded: bool  # FSDP
    autocast: Callable[[], contextlib.AbstractContextManager]
    head_in_slices: bool  # the head and loss a slice of positions at a time (`GPT.forward`'s return_logits=False)
    lora_base: Checkpoint | None = None  # a LoRA run's base checkpoint: the frozen weights its adapter corrects


def build_training_model(config: Config, ctx: Distributed, init: Checkpoint | None,
                         ckpt: Checkpoint | None, lora_memory: LoraMemory | None = None) -> TrainingModel:
    """The model of ``config`` seeded by the run's seed, with ``init``'s or ``ckpt``'s weights, on this process's
    device, wrapped for the processes of ``ctx``, and its optimizer. A LoRA run trains in less memory as
    ``lora_memory`` says (default: `LoraMemory.default`)."""
    mc, tc, device = config.model, config.train, ctx.device
    sharded = ctx.active and tc.parallel == "fsdp"
    autocast = autocast_for(device, tc.dtype)
    compute_dtype = torch.bfloat16 if autocast is not contextlib.nullcontext else None  # autocast_for's
    torch.manual_seed(tc.seed)  # the same initial weights in every process
    model = build_model(mc)
    lora, base = LoraSettings.of(tc), None
    if lora is not None:  # the base's weights, frozen, and the adapter (A seeded by the run's seed, B zero)
        base = init if init is not None else ckpt.base()
        load_weights(model, base.model_state(), base.path)
        add_lora(model, lora)
        if ckpt is not None:
            load_adapter(model, ckpt.adapter_state(), str(ckpt.path))
        lora_memory = lora_memory or LoraMemory.default(compute_dtype)
        read_base = functools.partial(read_tensor, base.path / MODEL_FILE)
        prepare_training(model, lora_memory, compute_dtype, read_base)
    else:
        if init is not None:
            load_weights(model, init.model_state(), init.path)
        if ckpt is not None and not sharded:  # a sharded model loads its shards after sharding
            ckpt.load_weights(model)
    model.to(device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # float32 matmuls on tensor cores
        torch.backends.cudnn.allow_tf32 = True
    wrapped = wrap_model(model, tc.parallel, ctx)
    # the fused AdamW kernel (CUDA, and CPU, where it is faster per step than the for-loop
    # version: benchmarks/train.py) for plain tensors; sharded (DTensor) parameters take the
    # default path
    fused = device.type in ("cuda", "cpu") and tc.optimizer in ("adamw", "muon") and not sharded
    optimizer = make_optimizer(model, tc, fused=fused)
    step_model = torch.compile(wrapped) if tc.compile else wrapped
    # evaluation and sampling skip DDP's gradient hooks; a sharded model must be called as itself
    eval_model = step_model if sharded else (torch.compile(model) if tc.compile else model)
    # Under bfloat16 autocast on a CPU a Transformer's head and loss run a slice of positions at a
    # time (model/head_loss.py: a faster step, benchmarks/train_step.py; none of the (B, T, |V|)
    # logits kept). Float32 training keeps the plain head and loss, so its figures stay bit for bit,
    # except in a LoRA run, whose peak the logits would otherwise set (`LoraMemory.head_in_slices`).
    head_in_slices = isinstance(model, GPT) and device.type == "cpu" and (
        compute_dtype is not None or (lora is not None and lora_memory.head_in_slices))
    return TrainingModel(model, step_model, eval_model, wrapped if ctx.active and not sharded else None, optimizer,
                         sharded, autocast, head_in_slices, base)
