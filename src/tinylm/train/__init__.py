"""Training: the loop, its schedule and optimizer, its batches, and the distributed engine.

- `train(config, run_dir, resume=..., ...)` -> `RunResult`: the whole job, from corpus to
  checkpoints, metrics, loss curve and a sample (`tinylm.train.loop`).
- `lr_at`: warmup, then warmup-stable-decay (the default recipe's: held, then decayed over the last
  steps), cosine, linear or constant (`tinylm.train.schedule`).
- `make_optimizer`, `parameter_groups`: Muon for the blocks' weight matrices beside AdamW for the rest
  (the default recipe), or AdamW or SGD alone, with weight-decay groups (`tinylm.train.optim`).
- `BatchSource`: packed windows or padded documents, a pure function of (seed, step)
  (`tinylm.train.batches`).
- `Distributed`: torchrun processes, DDP and FSDP (`tinylm.train.distributed`).
- Around the loop: what a run starts from (`tinylm.train.start`), what it prints
  (`tinylm.train.progress`), what its checkpoints hold (`tinylm.train.state`), and counting
  an n-gram model instead (`tinylm.train.ngram`). `prepare_data` and `default_data_dir` are
  `tinylm.data.prepare_run`'s, `RunResult` is `tinylm.run`'s, re-exported here.

A trained run is read back with `tinylm.run.load_run`.
"""

from tinylm.data.prepare_run import default_data_dir, prepare_data
from tinylm.run import RunResult
from tinylm.train.batches import BatchSource, MicroBatch, micro_batches
from tinylm.train.distributed import Distributed
from tinylm.train.loop import train
from tinylm.train.optim import make_optimizer, parameter_groups
from tinylm.train.schedule import lr_at
from tinylm.train.start import total_steps

__all__ = [
    "train", "RunResult", "prepare_data", "default_data_dir", "total_steps",
    "lr_at", "make_optimizer", "parameter_groups", "BatchSource", "MicroBatch", "micro_batches", "Distributed",
]
