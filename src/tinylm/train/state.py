"""A training run's state in a checkpoint: weights, optimizer moments, every process's random state, the counts.

`tinylm.checkpoint` writes and reads the folder; this module says what a training run puts in
it and takes back out, so that a resumed run ends with the weights an uninterrupted one would:

    state = checkpoint_state(tc, step=..., total=..., ...)                       # state.json's training part
    save_training_checkpoint(path, model, optimizer, ctx, sharded=..., config=..., tokenizer=..., state=state)
    restore(ckpt, model, optimizer, ctx, sharded=..., seed=tc.seed)               # on resume

A sharded (FSDP) model's weights and moments are gathered whole, onto process 0, so a checkpoint
is the same files whatever the number of processes that wrote it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from tinylm.checkpoint import Checkpoint, save_checkpoint
from tinylm.config import Config, TrainConfig
from tinylm.model.lora import is_adapter_name
from tinylm.tokenizers.base import Tokenizer
from tinylm.train.distributed import Distributed
from tinylm.train.optim import load_named_optimizer_state, named_optimizer_state, optimizers_of

DROPOUT_STREAM = 1  # the word that names the stream seeding each process's dropout


def derived_seed(seed: int, *words: int) -> int:
    """A 63-bit seed for a purpose (the words), from the run's seed: independent streams per use."""
    return int(np.random.SeedSequence([seed, *words]).generate_state(2, dtype=np.uint64)[0] >> np.uint64(1))


def seed_dropout(seed: int, rank: int, *words: int) -> None:
    """Seed this process's torch generator (dropout) from the run's seed and its rank."""
    torch.manual_seed(derived_seed(seed, DROPOUT_STREAM, rank, *words))


def full_state_dicts(model: torch.nn.Module, optimizer: Any, sharded: bool) -> tuple[dict[str, torch.Tensor],
                                                                                       dict[str, Any]]:
    """The model's and the optimizer's state, whole (a sharded model's gathered onto process 0)."""
    if sharded:
        # (only a sharded run needs PyTorch's distributed checkpointing)
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        # every process takes part in gathering the shards; process 0 receives them
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return (get_model_state_dict(model, options=options),
                get_optimizer_state_dict(model, optimizers_of(optimizer), options=options))
    return model.state_dict(), named_optimizer_state(model, optimizer)


def rng_states(ctx: Distributed) -> dict[str, torch.Tensor]:
    """Every process's torch random state (and CUDA's), by rank: what its dropout draws next."""
    states = {f"torch_cpu/rank{r}": t for r, t in enumerate(ctx.all_gather(torch.get_rng_state()))}
    if ctx.device.type == "cuda":
        cuda = ctx.all_gather(torch.cuda.get_rng_state(ctx.device))
        states.update({f"cuda/rank{r}": t for r, t in enumerate(cuda)})
    return states


def checkpoint_state(tc: TrainConfig, *, step: int, total: int, tokens: int, elapsed: float, best_val_loss: float,
                     best_step: int | None, world_size: int) -> dict[str, Any]:
    """state.json's training part: the counts, and how the data and random state are found again."""
    return {
        "step": step,
        "total_steps": total,
        "tokens": tokens,
        "elapsed": elapsed,
        "best_val_loss": None if np.isinf(best_val_loss) else best_val_loss,
        "best_step": best_step,
        "world_size": world_size,
        "data": {"mode": tc.batch_mode, "seed": tc.seed, "next_step": step,
                 "how": "micro-batch i of step s is drawn with numpy "
                        "default_rng([seed, s, i]): the position in the data is the step"},
        "rng": {"torch": "rng.safetensors: torch_cpu/rank<r> (and cuda/rank<r>), each "
                         "process's torch random state (dropout)",
                "numpy": "none kept: batches are a function of (seed, step)",
                "python": "random is not used"},
    }


def save_training_checkpoint(path: Path, model: torch.nn.Module, optimizer: Any, ctx: Distributed, *, sharded: bool,
                             config: Config, tokenizer: Tokenizer, state: dict[str, Any]) -> None:
    """Every process takes part (a sharded model is gathered, each random state collected); process 0 writes.
    A LoRA run writes its adapter only (``state`` names the base it adapts)."""
    model_state, optimizer_state = full_state_dicts(model, optimizer, sharded)
    if config.train.lora_rank:
        model_state = {name: t for name, t in model_state.items() if is_adapter_name(name)}
    rng = rng_states(ctx)
    if ctx.is_main:
        save_checkpoint(path, model_state=model_state, optimizer_state=optimizer_state, rng_state=rng,
                        config=config, tokenizer=tokenizer, state=state)
    ctx.barrier()


def restore(ckpt: Checkpoint, model: torch.nn.Module, optimizer: Any, ctx: Distributed, *, sharded: bool,
            seed: int) -> None:
    """Put back the optimizer's moments and this process's random state as ``ckpt`` saved them (and a sharded
    model's weights, which load after sharding; a plain model has its weights already)."""
    optimizer_state = ckpt.optimizer_state()
    if sharded:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True)
        set_model_state_dict(model, ckpt.model_state(), options=options)
        if optimizer_state is not None:
            set_optimizer_state_dict(model, optimizers_of(optimizer), optimizer_state, options=options)
    elif optimizer_state is not None:
        load_named_optimizer_state(model, optimizer, optimizer_state)
    rng = ckpt.rng_state()
    mine = rng.get(f"torch_cpu/rank{ctx.rank}")
    if mine is not None:
        torch.set_rng_state(mine)
    else:  # a process the checkpoint did not have
        seed_dropout(seed, ctx.rank, ckpt.step)
    cuda = rng.get(f"cuda/rank{ctx.rank}")
    if cuda is not None and ctx.device.type == "cuda":
        torch.cuda.set_rng_state(cuda, ctx.device)
