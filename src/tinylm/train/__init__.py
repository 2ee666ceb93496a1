"""Training: the loop, its schedule and optimizer, its batches, and the distributed engine.

- `train(config, run_dir, resume=..., ...)` -> `RunResult`: the whole job, from corpus to
  checkpoints, metrics, loss curve and a sample (`tinylm.train.loop`).
- `lr_at`: warmup then cosine or linear decay (`tinylm.train.schedule`).
- `make_optimizer`, `parameter_groups`: AdamW/SGD with weight-decay groups (`tinylm.train.optim`).
- `BatchSource`: packed windows or padded documents, a pure function of (seed, step)
  (`tinylm.train.batches`).
- `Distributed`: torchrun processes, DDP and FSDP (`tinylm.train.distributed`).

A trained run is read back with `tinylm.run.load_run`.
"""

from tinylm.train.batches import BatchSource, MicroBatch, micro_batches
from tinylm.train.distributed import Distributed
from tinylm.train.loop import RunResult, default_data_dir, prepare_data, total_steps, train
from tinylm.train.optim import make_optimizer, parameter_groups
from tinylm.train.schedule import lr_at

__all__ = [
    "train", "RunResult", "prepare_data", "default_data_dir", "total_steps",
    "lr_at", "make_optimizer", "parameter_groups", "BatchSource", "MicroBatch", "micro_batches", "Distributed",
]
