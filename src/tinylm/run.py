"""The run directory: what a trained model is on disk, and how everything above training loads it.

`tinylm train` writes one folder per run (``runs/<name>/`` by default)::

    config.toml            the resolved configuration, [model] and [train] (vocab_size is the tokenizer's)
    tokenizer.json         the tokenizer whose ids the model reads and writes
    run.json               what this run is: its data folder, status, step count, final metrics
    metrics.jsonl          one JSON object per line: training lines and evaluation lines, by step
    loss.png               the training and validation loss curves
    checkpoints/latest/    the most recent checkpoint: `--resume` continues from it
    checkpoints/best/      the checkpoint with the lowest validation loss seen so far

An n-gram run (``family = "ngram"``: counted, not trained) has no checkpoints: its model is one
file, ``ngram.npz`` (`tinylm.model.ngram.NGramModel.save`), beside the same config, tokenizer,
run.json and metrics.

What a checkpoint folder holds, and how it is written and verified, is `tinylm.checkpoint`; its
names are re-exported here, so ``from tinylm.run import load_checkpoint`` works as before. The
life of a run folder is here too: `check_new_run_folder` before a new run (training, counting an
n-gram model or importing one), `clear_run_folder` when it is replaced, `checkpoint_to_resume`.

Usage::

    run = load_run("runs/tiny-shakespeare")           # the best checkpoint, on the CPU
    logits, _ = run.model(torch.tensor([run.start_ids]))
    print(run.tokenizer.decode(...), run.step, run.metrics[-1])
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tinylm.atomic import atomic_write_text
from tinylm.checkpoint import (  # re-exported: a run's checkpoints are part of what a run is
    CHECKPOINT_NAMES,
    CHECKPOINTS,
    CONFIG_FILE,
    FORMAT_VERSION,
    LORA_BASE,
    MODEL_FILE,
    TOKENIZER_FILE,
    Checkpoint,
    NoCheckpoint,
    checkpoint_path,
    copy_checkpoint,
    find_checkpoint,
    flatten_optimizer_state,
    has_checkpoint,
    load_checkpoint,
    load_weights,
    lora_base_record,
    save_checkpoint,
    save_safetensors,
    unflatten_optimizer_state,
    verify_checkpoint,
)
from tinylm.config import FAMILY_NAMES, Config, build_config, dump_toml, load_config_file
from tinylm.data.shards import ShardSet
from tinylm.device import resolve_device
from tinylm.errors import TinyLMError
from tinylm.jsonfile import JSONFormat
from tinylm.lock import LOCK_FILE
from tinylm.model import NGramLM, NGramModel
from tinylm.tokenizers.base import Tokenizer, check_same_tokenizer, generation_excluded, load_tokenizer

RUN_FILE = "run.json"
RUN_INFO = JSONFormat(  # run.json: its version is written, and a run.json of any version is read
    "tinylm.run", FORMAT_VERSION, any_version=True,
    missing="{run_dir} is not a tinylm run (no {file}); train one with `tinylm train`",
    foreign="{path} is not a tinylm run description",
)
METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "loss.png"
SCHEDULE_FILE = "schedule.png"  # each optimizer group's learning rate, step by step
NGRAM_FILE = "ngram.npz"
COST_FILE = "cost.json"  # what a step costs and what the run cost (`tinylm.train.cost`)
NGRAM_DRAFT_FILE = "draft-ngram.npz"  # the counts speculative decoding drafts with (`generate.speculative`)
TENSORBOARD_DIR = "tensorboard"  # --log-to tensorboard's event files
WANDB_DIR = "wandb"  # --log-to wandb: wandb.init(dir=run) writes its runs in <run>/wandb
ADAPTER_FOLDER = "adapter"  # a LoRA run's adapter in PEFT's layout (`tinylm finetune --lora-rank`)
# Everything tinylm writes in a run folder, and so everything `--force` may delete: anything else
# there (a user's notes, a data folder put inside) is left where it is.
RUN_ENTRIES = frozenset({RUN_FILE, CONFIG_FILE, TOKENIZER_FILE, METRICS_FILE, PLOT_FILE, SCHEDULE_FILE, NGRAM_FILE,
                         COST_FILE, NGRAM_DRAFT_FILE, TENSORBOARD_DIR, WANDB_DIR, ADAPTER_FOLDER, CHECKPOINTS})
# a file being written atomically (`tinylm.atomic`): ".<name>.<pid>.tmp"
_TEMPORARY = re.compile(r"\.(?P<name>.+)\.\d+\.tmp")


# ----- the run directory --------------------------------------------------------------------------


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The lines of a metrics.jsonl file (a run folder or the file itself); a torn last line is skipped."""
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    if not path.exists():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # only a kill mid-write makes one, and only as the last line
    return rows


def write_metrics(path: str | os.PathLike, rows: Iterable[Mapping[str, Any]]) -> None:
    """Replace a metrics.jsonl file with ``rows``, atomically."""
    atomic_write_text(path, "".join(json.dumps(row) + "\n" for row in rows))


def read_run_info(run_dir: str | os.PathLike) -> dict[str, Any]:
    return RUN_INFO.read(Path(run_dir) / RUN_FILE, run_dir=run_dir)


def write_run_info(run_dir: str | os.PathLike, info: Mapping[str, Any]) -> None:
    atomic_write_text(Path(run_dir) / RUN_FILE, json.dumps({**RUN_INFO.header(), **info}, indent=1) + "\n")


def start_ids(config: Config, tokenizer: Tokenizer) -> list[int]:
    """What a prompt starts with, as documents started in training: BOS in document mode; otherwise what an
    imported tokenizer's own pipeline puts first (its BOS, or nothing: the model was trained on exactly
    that), and EOS (the separator a packed document follows) for tinylm's own tokenizers. Every command
    that builds a prompt (sample, next-token, eval, serve, explain, the samples of training) takes it from here."""
    return text_start_ids(tokenizer, documents=config.train.batch_mode == "documents")


def text_start_ids(tokenizer: Tokenizer, *, documents: bool = False) -> list[int]:
    """`start_ids` for a model trained in document mode (``documents``) or packed, whatever its configuration."""
    if documents:
        return [tokenizer.bos_id]
    own = tokenizer.pipeline_start_ids()
    return [tokenizer.eos_id] if own is None else list(own)


def empty_prompt_ids(config: Config, tokenizer: Tokenizer) -> list[int]:
    """What a sample without a prompt starts from: `start_ids`, or BOS where those are empty (a tokenizer that
    puts nothing first), as `transformers`' ``generate`` starts without input ids."""
    return start_ids(config, tokenizer) or [tokenizer.bos_id]


@dataclass
class Run:
    """A trained model as `load_run` gives it: ready to evaluate, sample from, serve or export."""

    path: Path
    config: Config
    tokenizer: Tokenizer
    model: torch.nn.Module  # GPT, RecurrentLM, or NGramLM (an n-gram run)
    checkpoint: Checkpoint | None  # None for an n-gram run
    info: dict[str, Any] = field(default_factory=dict)
    metrics: list[dict[str, Any]] = field(default_factory=list)

    @property
    def family(self) -> str:
        return self.config.model.family

    @property
    def step(self) -> int:
        return self.checkpoint.step if self.checkpoint is not None else int(self.info.get("step", 0))

    @property
    def start_ids(self) -> list[int]:
        """The prompt that starts a fresh document, as the model saw documents start in training."""
        return start_ids(self.config, self.tokenizer)

    @property
    def empty_prompt_ids(self) -> list[int]:
        """What a sample without a prompt starts from (`empty_prompt_ids`)."""
        return empty_prompt_ids(self.config, self.tokenizer)


def check_run_dir(run_dir: str | os.PathLike) -> Path:
    """``run_dir`` as a Path if it is a folder; a one-line error if it is a file or missing (a cheap first check)."""
    run_dir = Path(run_dir)
    if run_dir.is_file():
        hint = (" (an n-gram model file: evaluate it with `tinylm eval --run FILE --data-dir SHARDS`)"
                if run_dir.suffix == ".npz" else "")
        raise TinyLMError(f"{run_dir} is a file, not a run folder{hint}; give the folder `tinylm train` wrote")
    if not run_dir.is_dir():
        raise TinyLMError(f"run folder {run_dir} does not exist; train one with `tinylm train --out {run_dir}`")
    return run_dir


def load_run(run_dir: str | os.PathLike, checkpoint: str = "best", device: torch.device | str = "cpu") -> Run:
    """Load a trained run: its model (from checkpoint "best", falling back to "latest", or "latest"),
    tokenizer, configuration, run.json and metrics. ``checkpoint`` may also be a checkpoint folder."""
    run_dir = check_run_dir(run_dir)
    device = resolve_device(str(device))
    info = read_run_info(run_dir)
    if not (run_dir / CONFIG_FILE).is_file():
        raise TinyLMError(f"{run_dir} has no {CONFIG_FILE}: the run is incomplete (stopped before its first checkpoint, "
                          f"or files were removed); train it again with `tinylm train --out {run_dir} --force`")
    run_config = build_config(load_config_file(run_dir / CONFIG_FILE))
    if run_config.model.family == "ngram":
        return _load_ngram_run(run_dir, run_config, info, device)
    if checkpoint in CHECKPOINT_NAMES:
        candidates = [checkpoint] + (["latest"] if checkpoint == "best" else [])
        found = [checkpoint_path(run_dir, n) for n in candidates if has_checkpoint(checkpoint_path(run_dir, n))]
        if not found:
            raise TinyLMError(f"{run_dir} has no {checkpoint} checkpoint yet; train (or --resume) it first")
        ckpt = load_checkpoint(found[0])
    else:
        ckpt = load_checkpoint(checkpoint)
    if run_config.model != ckpt.config.model:
        raise TinyLMError(f"{ckpt.path} is a checkpoint of another model configuration than {run_dir / CONFIG_FILE}; "
                          "load it with the run it came from")
    model = ckpt.build_model(device)
    return Run(run_dir, ckpt.config, ckpt.tokenizer, model, ckpt, info, read_metrics(run_dir))


def _load_ngram_run(run_dir: Path, config: Config, info: dict[str, Any], device: torch.device | str) -> Run:
    """An n-gram run: its counts file behind the neural models' interface (`NGramLM`)."""
    tokenizer = load_tokenizer(run_dir / TOKENIZER_FILE)
    ngram = NGramModel.load(run_dir / NGRAM_FILE)
    again = "count it again with `tinylm train --model ngram --force`"
    if ngram.tokenizer_fingerprint is not None:
        check_same_tokenizer(ngram.tokenizer_fingerprint, tokenizer,
                             f"{run_dir / NGRAM_FILE} was not counted with {run_dir / TOKENIZER_FILE}", again)
    if ngram.vocab_size != tokenizer.vocab_size or ngram.eos_id != tokenizer.eos_id:
        raise TinyLMError(f"{run_dir / NGRAM_FILE} was not counted with {run_dir / TOKENIZER_FILE} (their "
                          f"vocabularies differ); {again}")
    model = NGramLM(ngram, config.model, never=generation_excluded(tokenizer)).to(device).eval()
    return Run(run_dir, config, tokenizer, model, None, info, read_metrics(run_dir))


# ----- a run folder's life: started, replaced, resumed --------------------------------------------


@dataclass
class RunResult:
    """What `tinylm.train.train` did: where the run is, how far it got, and how good the model is."""

    run_dir: Path
    status: str  # "complete", or "stopped" (stop_after reached; resume to continue)
    step: int  # optimizer steps done
    total_steps: int
    tokens: int  # training tokens seen
    train_loss: float | None  # the last logged training loss
    val: dict[str, Any] | None  # the final evaluation (loss, perplexity, bits per byte), if it ran
    checkpoint: Path  # checkpoints/latest (an n-gram run: its ngram.npz)
    best_checkpoint: Path | None
    plot: Path | None
    sample: str
    elapsed: float  # seconds of training, over all sessions of the run
    stopped_by: int | None = None  # the signal (SIGINT, SIGTERM) that stopped the run early, if one did

    @classmethod
    def of_folder(cls, out: Path, status: str, step: int, total_steps: int, tokens: int, train_loss: float | None,
                  val: dict[str, Any] | None, sample: str, elapsed: float) -> RunResult:
        """The result of the network's run in ``out``, with the checkpoints and loss curve it has on disk."""
        best, plot = checkpoint_path(out, "best"), out / PLOT_FILE
        return cls(out, status, step, total_steps, tokens, train_loss, val, checkpoint_path(out, "latest"),
                   best if best.exists() else None, plot if plot.exists() else None, sample, elapsed)


def check_new_run_folder(out: Path, force: bool, *, resumable: bool = True, folder_arg: str = "out_dir") -> None:
    """A new run may go in ``out``: it is missing or empty, or ``force`` allows replacing the old run there.

    Only a tinylm run may be replaced: a folder whose run.json tinylm wrote (every run folder gets
    one before anything else). Nothing is deleted here: `clear_run_folder` does that once the data
    and the model are ready, so a mistake found on the way (a missing corpus, a bad setting) leaves
    the old run intact. ``resumable``: whether the advice may offer resuming (training does;
    importing does not). ``folder_arg``: the caller's name for the folder argument.

    The advice names each way out twice, as the command's flag and as the Python argument, since both
    the command and a script reach here.
    """
    another = f"choose another folder (--out; {folder_arg}= from Python)"
    if out.exists() and not out.is_dir():
        raise TinyLMError(f"{out} is a file; a run is a folder: {another}")
    blocking = next((p for p in out.parents if p.exists() and not p.is_dir()), None)
    if blocking is not None:
        raise TinyLMError(f"{out} cannot be made: {blocking} is a file, not a folder; {another}")
    entries = _entries(out)
    if not entries:
        return
    if not force:
        how = ("continue that run with --resume (resume=True), start it over with --force (force=True; it "
               f"deletes that run), or {another}" if resumable
               else f"{another}, or replace it with --force (force=True)")
        raise TinyLMError(f"{out} already exists; {how}")
    if not is_run_folder(out):
        shown = ", ".join(entries[:4]) + (", ..." if len(entries) > 4 else "")
        raise TinyLMError(f"{out} is not a tinylm run folder (it has no {RUN_FILE} written by tinylm; it holds {shown}); "
                          f"--force (force=True) replaces only run folders tinylm made, so {another}")


def is_run_folder(folder: Path) -> bool:
    """Whether ``folder`` is a run tinylm made: its run.json is tinylm's run description."""
    try:
        read_run_info(folder)
    except TinyLMError:
        return False
    return True


def _entries(folder: Path) -> list[str]:
    """The names in ``folder`` (none if it is missing), leaving out the lock a tinylm process holds on it."""
    if not folder.is_dir():
        return []
    return sorted(p.name for p in folder.iterdir() if p.name != LOCK_FILE)


def _is_run_entry(name: str) -> bool:
    m = _TEMPORARY.fullmatch(name)
    return name in RUN_ENTRIES or (m is not None and m["name"] in RUN_ENTRIES)


def clear_run_folder(out: Path, keep: Path | None = None) -> list[str]:
    """Delete the old run in ``out`` (checked by `check_new_run_folder`), just before the new one is written.

    Only what a run holds is deleted (`RUN_ENTRIES`, and their temporary files); anything else in
    the folder stays, and its names are returned. ``keep``: the data folder, spared if it lies
    inside ``out`` (the new run reads it).
    """
    if not out.is_dir():
        return []
    keep = keep.resolve() if keep is not None else None
    kept = []
    for entry in sorted(out.iterdir()):
        if entry.name == LOCK_FILE:
            continue
        spared = keep is not None and (entry.resolve() == keep or entry.resolve() in keep.parents)
        if spared or not _is_run_entry(entry.name):
            kept.append(entry.name)
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    return kept


def run_family(config: Config | None, out: Path) -> str:
    """The model family of ``config``, or (resuming with the run's own settings) of the run in ``out``."""
    if config is not None:
        return config.model.family
    saved = out / CONFIG_FILE
    if not saved.is_file():
        return "gpt"
    return build_config(load_config_file(saved)).model.family


def check_same_family(config: Config, out: Path) -> None:
    """Resuming the run in ``out`` with ``config``: both must be of one model family."""
    if not (out / CONFIG_FILE).is_file():
        return
    theirs = run_family(None, out)
    if theirs != config.model.family:
        raise TinyLMError(f"{out} is a run of {FAMILY_NAMES[theirs]} model, not {FAMILY_NAMES[config.model.family]} "
                          "one; resume it with its own settings (drop --model), or start the new run in another "
                          "--out")


def checkpoint_to_resume(out: Path, resume: bool | str) -> Checkpoint:
    """The checkpoint ``resume`` names in the run ``out``: True or "latest", "best", or a checkpoint folder."""
    if out.exists() and not out.is_dir():
        raise TinyLMError(f"cannot resume: {out} is a file, not a run folder; give the folder the run was written to")
    if not out.is_dir():
        raise TinyLMError(f"cannot resume: {out} does not exist; start the run without --resume")
    which = "latest" if resume is True else str(resume)
    path = checkpoint_path(out, which) if which in ("latest", "best") else Path(which)
    try:
        return load_checkpoint(path)
    except NoCheckpoint:
        raise TinyLMError(f"cannot resume: {out} has no {which} checkpoint yet (it stopped before the first "
                          "one); start it again with --force") from None


def update_run_info(run_dir: str | os.PathLike, **fields: Any) -> None:
    """Change some fields of run.json (its format and version stay as they are written)."""
    info = read_run_info(run_dir)
    info.update(fields)
    info.pop("format", None)
    info.pop("version", None)
    write_run_info(run_dir, info)


def write_run_files(out: Path, config: Config, tokenizer: Tokenizer, info: Mapping[str, Any],
                    metrics_up_to: int | None = None) -> None:
    """config.toml, tokenizer.json and run.json of the run in ``out`` (made if missing). ``metrics_up_to``:
    keep only the metrics lines of steps up to it (later ones describe steps a resumed run does again)."""
    out.mkdir(parents=True, exist_ok=True)
    write_run_info(out, info)  # first: a folder with tinylm's run.json is a run, and only a run is ever replaced
    atomic_write_text(out / CONFIG_FILE, dump_toml(config.to_dict()))
    tokenizer.save(out / TOKENIZER_FILE)
    if metrics_up_to is not None:
        rows = read_metrics(out / METRICS_FILE)
        write_metrics(out / METRICS_FILE, [r for r in rows if r.get("step", 0) <= metrics_up_to])


def data_info(shards: ShardSet) -> dict[str, Any]:
    """What run.json records of the data a run learned from: where it is and which text and tokenizer."""
    meta = shards.meta
    return {"dir": str(shards.path.resolve()), "corpus": meta["corpus"], "input_fingerprint": meta["input_fingerprint"],
            "tokenizer_fingerprint": meta["tokenizer"]["fingerprint"]}


__all__ = [
    # the run folder
    "RUN_FILE", "METRICS_FILE", "PLOT_FILE", "SCHEDULE_FILE", "NGRAM_FILE", "CONFIG_FILE", "TOKENIZER_FILE",
    "read_metrics", "write_metrics", "read_run_info", "write_run_info", "start_ids", "text_start_ids",
    "empty_prompt_ids", "Run", "check_run_dir",
    "load_run", "RunResult", "check_new_run_folder", "is_run_folder", "clear_run_folder", "RUN_ENTRIES",
    "COST_FILE", "ADAPTER_FOLDER", "NGRAM_DRAFT_FILE", "TENSORBOARD_DIR", "WANDB_DIR", "run_family", "check_same_family",
    "checkpoint_to_resume", "update_run_info", "write_run_files", "data_info",
    # its checkpoints (tinylm.checkpoint)
    "CHECKPOINTS", "CHECKPOINT_NAMES", "FORMAT_VERSION", "LORA_BASE", "MODEL_FILE", "lora_base_record", "Checkpoint", "checkpoint_path",
    "copy_checkpoint", "find_checkpoint", "flatten_optimizer_state", "has_checkpoint", "load_checkpoint",
    "load_weights", "save_checkpoint", "save_safetensors", "unflatten_optimizer_state", "verify_checkpoint",
]
