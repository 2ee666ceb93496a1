"""Where a run's metrics go: metrics.jsonl always, and TensorBoard or Weights & Biases when asked.

The training loop hands each metrics row, ``{"kind": "train", "step": 40, "loss": 2.31, "lr": ...}``,
to a `MetricsLog` made by `open_metrics_log`, which passes it to one sink per backend of the
``[train] log_to`` setting (``--log-to tensorboard,wandb``):

- jsonl: the row as one line of metrics.jsonl, the run's own record (always written).
- tensorboard: event files in ``<run>/tensorboard``, written by PyTorch's `SummaryWriter`
  (``tensorboard --logdir runs``); the resolved configuration is logged as text.
- wandb: a Weights & Biases run, offline by default: written under ``<run>/wandb`` with no
  account and no network, for ``wandb sync`` to upload later; online with ``wandb_mode = "online"``.

TensorBoard and W&B get each number of a row under ``<kind>/<key>``, the row's own names:
``train/loss``, ``train/lr``, ``train/tokens_per_s``, ``eval/val_loss``, ``eval/val_bpb``,
``final/val_bpb``, ... at the row's step. So every chart is a column of metrics.jsonl.

Resuming redoes the steps after the checkpoint, and metrics.jsonl drops their rows. TensorBoard is
told to hide what it had from there on (``purge_step``). The W&B run id is kept in
``<run>/wandb/tinylm-run-id``, so a resumed run continues the same W&B run (offline: one folder a
session, the same id, for ``wandb sync`` to join); a step logged again has the same loss, since a
resumed run computes what the uninterrupted one would, so whichever copy W&B shows is right.

The backends are optional extras, imported only when a run asks for them.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

from tinylm.atomic import atomic_write_text
from tinylm.config import Config, dump_toml
from tinylm.errors import TinyLMError
from tinylm.run import METRICS_FILE, TENSORBOARD_DIR, WANDB_DIR

WANDB_ID_FILE = f"{WANDB_DIR}/tinylm-run-id"


class MetricsSink(Protocol):
    """One backend: it is handed every metrics row, then closed once."""

    where: str  # for the run's header: what it writes, and how to look at it

    def log(self, row: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def scalars(row: dict[str, Any]) -> dict[str, float]:
    """A row's numbers under the names TensorBoard and W&B show: ``{"train/loss": 2.31, ...}``.

    Flags (``val_prorated``) are left out: they describe a number, and a chart of them says nothing.
    """
    return {f"{row['kind']}/{key}": float(value) for key, value in row.items()
            if key not in ("kind", "step") and isinstance(value, (int, float)) and not isinstance(value, bool)}


def check_backends(backends: tuple[str, ...]) -> None:
    """Stop before anything is trained if a backend's package is not installed."""
    for backend in backends:
        if backend != "jsonl":
            _require(backend)


def _require(backend: str) -> ModuleType:
    # Imported here, not at the top: a run that does not ask for tensorboard or wandb needs neither installed.
    try:
        return importlib.import_module(backend)
    except ImportError:
        raise TinyLMError(f"--log-to {backend} needs the {backend} package: pip install -e '.[{backend}]'") from None


class JsonlSink:
    """metrics.jsonl: one JSON object a line, the file opened for each row so a kill loses at most that line."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / METRICS_FILE
        self.where = str(self.path)

    def log(self, row: dict[str, Any]) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")

    def close(self) -> None:
        pass


class TensorBoardSink:
    """Event files in ``<run>/tensorboard``, one per session of the run."""

    def __init__(self, run_dir: Path, config: Config, start_step: int) -> None:
        _require("tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        log_dir = run_dir / TENSORBOARD_DIR
        # A resumed run logs again from start_step + 1; TensorBoard's reader then hides what earlier
        # sessions logged from that step on, as metrics.jsonl dropped those rows.
        self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=start_step + 1 if start_step else None)
        # indented four spaces: TensorBoard renders text as Markdown, and this keeps the TOML a code block
        toml = dump_toml(config.to_dict())
        self.writer.add_text("config", "".join(f"    {line}\n" for line in toml.splitlines()), global_step=start_step)
        self.where = f"TensorBoard (tensorboard --logdir {log_dir})"

    def log(self, row: dict[str, Any]) -> None:
        for tag, value in scalars(row).items():
            self.writer.add_scalar(tag, value, global_step=row["step"])

    def close(self) -> None:
        self.writer.close()  # flushes


class WandbSink:
    """A W&B run: offline under ``<run>/wandb`` unless ``wandb_mode`` is online; the same run id on every resume."""

    def __init__(self, run_dir: Path, config: Config) -> None:
        wandb = _require("wandb")
        tc = config.train
        id_file = run_dir / WANDB_ID_FILE
        # a new run's folder is empty (--force clears it), so a stored id is this run's own; without one, W&B
        # picks the id
        run_id = id_file.read_text(encoding="utf-8").strip() if id_file.is_file() else None
        try:
            self.run = wandb.init(
                project=tc.wandb_project, name=run_dir.name, id=run_id, resume="allow", dir=run_dir,
                mode=tc.wandb_mode, config=config.to_dict(), allow_val_change=True,  # a resume may change log_to
                # a run of its own beside any the caller has open; no banner, no copy of the console, no git
                # commands in whatever folder the run was started from
                reinit="create_new", settings=wandb.Settings(silent=True, console="off", disable_git=True),
            )
        except wandb.errors.Error as e:
            raise TinyLMError(f"--log-to wandb could not start a W&B run ({e}); for an online run log in with "
                              "`wandb login`, or keep --wandb-mode offline") from None
        atomic_write_text(id_file, self.run.id + "\n")
        sync_dir = self.run.settings.sync_dir
        self.where = (f"W&B run {self.run.id} at {self.run.url}" if tc.wandb_mode == "online"
                      else f"W&B offline run {self.run.id} (upload: wandb sync {sync_dir})")

    def log(self, row: dict[str, Any]) -> None:
        # rows of one step (train, eval, final) are merged into one W&B history row
        self.run.log(scalars(row), step=row["step"])

    def close(self) -> None:
        self.run.finish()


class MetricsLog:
    """Every sink of a run, as one: `log` hands a row to each, `close` closes each."""

    def __init__(self, sinks: list[MetricsSink]) -> None:
        self.sinks = sinks

    def log(self, row: dict[str, Any]) -> None:
        for sink in self.sinks:
            sink.log(row)

    def close(self) -> None:
        errors = []
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as e:  # close the others all the same: their files are worth keeping
                errors.append(e)
        self.sinks = []
        if errors:
            raise errors[0]

    @property
    def where(self) -> list[str]:
        return [sink.where for sink in self.sinks]


def open_metrics_log(config: Config, run_dir: Path, start_step: int = 0) -> MetricsLog:
    """A sink per backend of ``config.train.log_to``, for a run in ``run_dir`` that goes on from ``start_step``."""
    metrics = MetricsLog([])
    try:
        for backend in config.train.log_backends:
            if backend == "jsonl":
                metrics.sinks.append(JsonlSink(run_dir))
            elif backend == "tensorboard":
                metrics.sinks.append(TensorBoardSink(run_dir, config, start_step))
            elif backend == "wandb":
                metrics.sinks.append(WandbSink(run_dir, config))
    except BaseException:
        metrics.close()
        raise
    return metrics
