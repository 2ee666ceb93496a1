"""Many processes, one training run: PyTorch's own engine (torchrun, DDP, FSDP), nothing home-made.

Run the same command under ``torchrun``::

    torchrun --nproc-per-node 2 -m tinylm train --max-steps 100

torchrun starts one process per device and tells each who it is through environment variables
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT); `Distributed.from_env` reads them and
joins the process group (NCCL between GPUs, gloo on CPUs). Without them it is a group of one,
and every helper below does the trivial thing.

How the work is split (see `tinylm.train.loop`):

- **Data parallel (DDP).** Every process holds the whole model. The global batch of each step
  is the same as in one process; process r takes its rows [r B/W, (r+1) B/W). After the backward
  pass DDP averages the gradients over processes, so every process applies the same update.
- **Fully sharded (FSDP).** As DDP, but each process keeps only a 1/W shard of every weight,
  gradient and optimizer moment, gathering a layer's full weights just for its forward and
  backward pass: less memory per device for the same arithmetic.
- Process 0 alone logs and writes files; evaluation sums are added up over all processes.
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist

from tinylm.device import resolve_device
from tinylm.errors import TinyLMError

T = TypeVar("T")


@dataclass
class Distributed:
    """Who this process is in the run, and the few collective operations training needs."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    device: torch.device = torch.device("cpu")
    initialized: bool = False  # True when this object joined a process group (and must leave it)

    @classmethod
    def from_env(cls, device_setting: str = "auto") -> Distributed:
        """Join the process group torchrun describes in the environment, or be a group of one."""
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
        device = resolve_device(device_setting, local_rank)
        if world_size == 1:
            return cls(device=device)
        if device.type == "cuda":
            torch.cuda.set_device(device)  # NCCL and every later .cuda() use this process's own GPU
        backend = "nccl" if device.type == "cuda" else "gloo"
        initialized = False
        if not dist.is_initialized():
            dist.init_process_group(backend=backend, device_id=device if device.type == "cuda" else None)
            initialized = True
        return cls(rank, world_size, local_rank, local_world_size, device, initialized)

    @property
    def is_main(self) -> bool:
        """Process 0: the one that logs and writes files."""
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world_size > 1

    def barrier(self) -> None:
        if self.active:
            dist.barrier()

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum over processes, in place (a no-op alone)."""
        if self.active:
            dist.all_reduce(tensor)
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every process's copy of a same-shaped tensor, in rank order (CPU tensors out)."""
        if not self.active:
            return [tensor.cpu()]
        on_device = tensor.to(self.device)
        out = [torch.empty_like(on_device) for _ in range(self.world_size)]
        dist.all_gather(out, on_device)
        return [t.cpu() for t in out]

    def main_first(self, fn: Callable[[], T]) -> T | None:
        """Run ``fn`` on process 0 while the others wait; a `TinyLMError` there is raised everywhere.

        For work that writes shared files once (preparing data, creating the run folder): the
        others read the result after. Returns fn's result on process 0, None elsewhere.
        """
        result, error = None, None
        if self.is_main:
            try:
                result = fn()
            except TinyLMError as e:
                error = str(e)
        if self.active:
            box = [error]
            dist.broadcast_object_list(box, src=0)
            error = box[0]
        if error is not None:
            raise TinyLMError(error)
        return result

    def agree(self, value: T) -> T:
        """Process 0's ``value``, on every process."""
        if not self.active:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def close(self, clean: bool = True) -> None:
        """Leave the process group (only if this object joined it).

        After a clean finish every process first frees what still holds the group (a sharded
        model's hooks form reference cycles) and waits for the others at a barrier, which also
        drains this process's pending work. Tearing gloo down with work in flight, or collecting
        a sharded module after the group is gone, can abort the process at exit ("terminate
        called without an active exception"), one run in many. After an error there is no
        barrier: the other processes may never reach it.
        """
        if not (self.initialized and dist.is_initialized()):
            return
        if clean:
            gc.collect()
            dist.barrier()
        dist.destroy_process_group()
        self.initialized = False


def wrap_model(model: torch.nn.Module, parallel: str, ctx: Distributed) -> torch.nn.Module:
    """The model as the training step calls it: itself alone, or wrapped in DDP or sharded by FSDP.

    FSDP shards each Transformer block, then the rest (embedding, final norm, head), in place:
    ``model`` itself becomes the sharded module, its parameters distributed tensors.
    """
    if not ctx.active:
        return model
    if parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids)
    if parallel == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for block in getattr(model, "blocks", ()):  # a recurrent model is sharded as one unit
            fully_shard(block)
        fully_shard(model)
        return model
    raise TinyLMError(f"unknown parallel mode {parallel!r}; expected ddp or fsdp")


def gradient_sync(model: torch.nn.Module, ddp: torch.nn.Module | None, sharded: bool,
                  sync: bool) -> contextlib.AbstractContextManager:
    """The context of one micro-batch's backward pass: gradients are averaged across processes only when
    ``sync`` (the last micro-batch of a step), so accumulation needs no traffic."""
    if sharded:
        model.set_requires_gradient_sync(sync)
        return contextlib.nullcontext()
    if ddp is not None and not sync:
        return ddp.no_sync()
    return contextlib.nullcontext()
