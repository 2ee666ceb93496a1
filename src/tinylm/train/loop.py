"""The training loop: maximum likelihood by mini-batch gradient descent, resumable and reproducible.

One optimizer step, as in nanoGPT, written out::

    lr = lr_at(step)                                   warmup, then cosine/linear decay
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

Usage::

    config = resolve_config(preset="tiny", overrides={"max_steps": 200})
    result = train(config, "runs/mine")
    result = train(None, "runs/mine", resume=True)      # after an interruption
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import shutil
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from tinylm.atomic import atomic_write_text
from tinylm.config import FAMILY_NAMES, Config, TrainConfig, dump_toml
from tinylm.data.corpora import corpus_stem, load_corpus
from tinylm.data.shards import META_FILE, ShardSet, prepare
from tinylm.errors import TinyLMError
from tinylm.evaluate import EvalResult, evaluate, restrict, window_starts
from tinylm.explain.accounting import summary
from tinylm.generate.reference import reference_generate
from tinylm.generate.sampling import SamplingParams
from tinylm.model import build_model
from tinylm.model.gpt import GPT, IGNORE_INDEX
from tinylm.run import (
    CONFIG_FILE,
    METRICS_FILE,
    PLOT_FILE,
    SCHEDULE_FILE,
    RUN_FILE,
    TOKENIZER_FILE,
    Checkpoint,
    checkpoint_path,
    copy_checkpoint,
    has_checkpoint,
    load_checkpoint,
    load_weights,
    read_metrics,
    read_run_info,
    save_checkpoint,
    start_ids,
    write_metrics,
    write_run_info,
)
from tinylm.tokenizers.base import Tokenizer, load_tokenizer
from tinylm.train.batches import BatchSource, micro_batches
from tinylm.train.distributed import Distributed, wrap_model
from tinylm.train.metrics_sinks import MetricsLog, check_backends, open_metrics_log
from tinylm.train.optim import (
    load_named_optimizer_state,
    make_optimizer,
    named_optimizer_state,
    optimizers_of,
    set_schedule,
)
from tinylm.train.schedule import lr_at, momentum_at

# [train] settings that may differ when a run is resumed: they change what is logged, where it
# runs and how fast, never which batches are drawn or how the weights are updated.
RESUMABLE_CHANGES = frozenset({
    "tokenizer",  # checked by fingerprint instead: the same tokenizer in another file is fine
    "data_dir", "eval_interval", "eval_tokens", "final_eval_tokens", "eval_batch_size", "checkpoint_interval",
    "log_interval", "device", "dtype", "compile", "threads", "parallel",
    "sample_tokens", "sample_temperature", "sample_top_k", "log_to", "wandb_project", "wandb_mode",
})
# The budget may grow on resume (extending a run); `_Trainer` says what that does to the schedule.
BUDGET_SETTINGS = frozenset({"max_steps", "max_tokens"})


@dataclass
class RunResult:
    """What `train` did: where the run is, how far it got, and how good the model is."""

    run_dir: Path
    status: str  # "complete", or "stopped" (stop_after reached; resume to continue)
    step: int  # optimizer steps done
    total_steps: int
    tokens: int  # training tokens seen
    train_loss: float | None  # the last logged training loss
    val: dict[str, Any] | None  # the final evaluation (loss, perplexity, bits per byte), if it ran
    checkpoint: Path  # checkpoints/latest
    best_checkpoint: Path | None
    plot: Path | None
    sample: str
    elapsed: float  # seconds of training, over all sessions of the run


# ----- the budget and the data --------------------------------------------------------------------


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


def default_data_dir(tc: TrainConfig, corpus_name: str, tokenizer: Tokenizer | None = None) -> Path:
    """data/<corpus>-<tokenizer>: the kind and size of the tokenizer to train, or a given one's fingerprint."""
    name = corpus_stem(corpus_name)
    if tokenizer is not None:
        return Path("data") / f"{name}-{tokenizer.kind}-{tokenizer.fingerprint()[:8]}"
    if tc.tokenizer_kind == "char":
        return Path("data") / f"{name}-char"
    suffix = f"-{tc.tokenizer_pattern}" if tc.tokenizer_kind == "bpe" and tc.tokenizer_pattern != "gpt4" else ""
    return Path("data") / f"{name}-{tc.tokenizer_kind}-{tc.tokenizer_vocab_size}{suffix}"


def prepare_data(
    tc: TrainConfig, tokenizer: Tokenizer | None = None, log: Callable[[str], None] = print, *,
    reuse_only: bool = False,
) -> ShardSet:
    """The token shards training reads: prepared once into the data folder, reused after.

    The tokenizer is ``tokenizer`` if given (resuming, or starting from another run), else the
    file ``tc.tokenizer``, else the one already in the data folder if it is of the configured
    kind and size, else one trained on the corpus now. ``reuse_only``: the folder was named by a
    file (a run's run.json), not by the user, so it is only read, never written.
    """
    corpus = load_corpus(tc.corpus, glob=tc.glob, text_field=tc.text_field, errors=tc.errors, encoding=tc.encoding)
    if tokenizer is None and tc.tokenizer is not None:
        tokenizer = load_tokenizer(tc.tokenizer)
    data_dir = Path(tc.data_dir) if tc.data_dir else default_data_dir(tc, corpus.name, tokenizer)
    existing = data_dir / TOKENIZER_FILE if (data_dir / META_FILE).exists() else None
    if tokenizer is None and existing is not None:
        candidate = load_tokenizer(existing)
        if _is_requested_tokenizer(candidate, tc):
            tokenizer = candidate
        elif _is_requested_tokenizer(candidate, tc, smaller=True):
            # the corpus could not fill the vocabulary asked for: reuse it if training again gives the same one
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "ran out of pairs to merge" was said when the data was made
                again = _train_tokenizer(corpus, tc)
            if again.fingerprint() != candidate.fingerprint():
                raise TinyLMError(
                    f"{data_dir} holds shards made with a {candidate.kind} tokenizer of {candidate.vocab_size} tokens, "
                    f"and one trained on {corpus.name} now is another (has the corpus changed?); set --data-dir "
                    "to another folder")
            tokenizer = candidate
        else:
            raise TinyLMError(
                f"{data_dir} holds shards made with a {candidate.kind} tokenizer of {candidate.vocab_size} tokens, "
                f"not the {tc.tokenizer_kind} tokenizer of {tc.tokenizer_vocab_size} asked for; "
                "set --data-dir to another folder"
            )
    if tokenizer is not None and existing is not None:
        made_with = ShardSet.open(data_dir).meta["tokenizer"]["fingerprint"]
        if made_with != tokenizer.fingerprint():
            raise TinyLMError(
                f"{data_dir} holds shards made with another tokenizer (fingerprint {made_with}) than this run's "
                f"({tokenizer.fingerprint()}); set --data-dir to another folder"
            )
    if tokenizer is None:
        start = time.perf_counter()
        tokenizer = _train_tokenizer(corpus, tc)
        log(f"trained a {tokenizer.kind} tokenizer with |V| = {tokenizer.vocab_size} on {corpus.name} "
            f"in {time.perf_counter() - start:.1f}s")
    try:
        shards = prepare(corpus, tokenizer, data_dir, val_fraction=tc.val_fraction, progress=_is_tty(),
                         reuse_only=reuse_only)
    except TinyLMError as e:
        # prepare's advice is for `tinylm prepare`; train's --force deletes the run, not the shards
        raise TinyLMError(str(e).replace("choose another output folder or pass --force",
                                         "set --data-dir to another folder")) from None
    if shards.num_tokens("train") == 0 or shards.num_tokens("val") == 0:
        raise TinyLMError(f"corpus {corpus.name!r} is too small to give both a training and a validation split")
    return shards


def _is_requested_tokenizer(tok: Tokenizer, tc: TrainConfig, smaller: bool = False) -> bool:
    """Whether ``tok`` is of the kind, pattern and size ``tc`` asks for (``smaller``: of fewer tokens than asked)."""
    if tok.kind != tc.tokenizer_kind:
        return False
    if tok.kind == "char":
        return not smaller
    if tok.kind == "bpe":
        from tinylm.tokenizers.bpe import resolve_pattern

        if tok.pattern != resolve_pattern(tc.tokenizer_pattern):
            return False
    return tok.vocab_size < tc.tokenizer_vocab_size if smaller else tok.vocab_size == tc.tokenizer_vocab_size


def _train_tokenizer(corpus, tc: TrainConfig) -> Tokenizer:
    from tinylm.tokenizers import train_tokenizer

    return train_tokenizer(tc.tokenizer_kind, corpus.texts(), vocab_size=tc.tokenizer_vocab_size,
                           pattern=tc.tokenizer_pattern, progress=_is_tty())


# ----- configuration checks -----------------------------------------------------------------------


def group_lr(tc: TrainConfig, total: int, step: int, peak: float) -> float:
    """The schedule of ``tc`` over ``total`` steps at ``step``, for a group whose peak rate is ``peak``
    (its floor: the same share of it)."""
    floor = tc.final_lr if peak == tc.lr else tc.final_lr * peak / tc.lr
    return lr_at(step, lr=peak, min_lr=floor, warmup=tc.warmup_steps, total=total,
                 decay=tc.decay, fraction=tc.decay_fraction, shape=tc.decay_shape)


def config_differences(old: Config, new: Config, allowed: frozenset[str] = frozenset()) -> list[str]:
    """"[table] key: old -> new" for every setting that differs, except the [train] keys in ``allowed``."""
    out = []
    for section in ("model", "train"):
        a, b = dataclasses.asdict(getattr(old, section)), dataclasses.asdict(getattr(new, section))
        for key in a:
            if a[key] != b[key] and not (section == "train" and key in allowed):
                out.append(f"[{section}] {key}: {a[key]!r} -> {b[key]!r}")
    return out


# ----- small helpers ------------------------------------------------------------------------------


def _is_tty() -> bool:
    return sys.stderr is not None and sys.stderr.isatty()


def native_bf16(device: torch.device) -> bool:
    """Whether ``device`` multiplies bfloat16 matrices in hardware: a GPU that has it, or a CPU with
    AVX512-BF16 or AMX. Elsewhere PyTorch emulates bfloat16 on the CPU, slower than float32."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    return False


def _autocast(device: torch.device, dtype: str) -> Callable[[], contextlib.AbstractContextManager]:
    """A factory of the mixed-precision context: bfloat16 autocast, or nothing (float32)."""
    use_bf16 = dtype == "bfloat16" or (dtype == "auto" and native_bf16(device))
    if not use_bf16:
        return contextlib.nullcontext
    # Matmuls run in bfloat16, reductions (softmax, norms, the loss) stay in float32: autocast's
    # per-operation policy. bfloat16 has float32's range, so no loss scaling is needed.
    return lambda: torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def _precision_name(device: torch.device, dtype: str) -> str:
    return "bfloat16 autocast" if _autocast(device, dtype) is not contextlib.nullcontext else "float32"


def _derived_seed(seed: int, *words: int) -> int:
    """A 63-bit seed for a purpose (the words), from the run's seed: independent streams per use."""
    return int(np.random.SeedSequence([seed, *words]).generate_state(2, dtype=np.uint64)[0] >> np.uint64(1))


_DROPOUT_STREAM = 1  # the word that names the stream seeding each process's dropout


def _oom_message(tc: TrainConfig, block_size: int, device: torch.device) -> str:
    return (
        f"out of memory on {device} with batch_size {tc.batch_size} x block_size {block_size}: lower batch_size "
        f"(--batch-size {max(tc.batch_size // 2, 1)} --grad-accum {tc.grad_accum * 2} keeps the same batch per step) "
        "or block_size, or use a smaller model"
    )


@contextlib.contextmanager
def _memory_errors_explained(tc: TrainConfig, block_size: int, device: torch.device) -> Iterator[None]:
    try:
        yield
    except (torch.OutOfMemoryError, MemoryError):
        raise TinyLMError(_oom_message(tc, block_size, device)) from None
    except RuntimeError as e:
        text = str(e)
        if "out of memory" in text or "can't allocate memory" in text:
            raise TinyLMError(_oom_message(tc, block_size, device)) from None
        raise


@contextlib.contextmanager
def _threads(n: int | None) -> Iterator[None]:
    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _default_cpu_threads(processes: int) -> int:
    """Threads per process: the cores this machine has free, shared among its processes.

    Small models on a few cores are hurt badly by oversubscription: on a 2-core machine with
    another busy process, the tiny preset ran 3-10x slower with 2 threads than with 1
    (benchmarks/train.py --threads). So cores that are busy now (`_busy_cores`) are left out.
    """
    cores = _available_cpus()
    busy = round(_busy_cores())
    return max(1, min(cores, cores - busy) // processes)


def _busy_cores(window: float = 0.25) -> float:
    """How many of this process's cores are busy now: each one's non-idle share over ``window`` seconds, summed.

    Read from /proc/stat (Linux) for the cores in this process's affinity set. Elsewhere, the
    1-minute load average; but that counts recent work too, this process's own included, so a
    second run straight after a first (or the next model of a benchmark) would see the cores it
    just used as taken. The price of a short sample: a neighbour that is bursty and happens to be
    idle in the window is not counted (``--threads`` sets the count outright).
    """
    try:
        cores = os.sched_getaffinity(0)
        before = _cpu_times(cores)
        time.sleep(window)
        after = _cpu_times(cores)
        if before.keys() != cores or after.keys() != cores:
            raise OSError("/proc/stat does not list this process's cores")
    except (AttributeError, OSError, ValueError, IndexError):
        try:
            return float(int(os.getloadavg()[0]))  # whole cores: a load of 1.6 leaves the second core free
        except (AttributeError, OSError):  # no load average on this platform
            return 0.0
    busy = 0.0
    for n in cores:
        total = after[n][0] - before[n][0]
        if total > 0:
            busy += 1 - (after[n][1] - before[n][1]) / total
    return busy


def _cpu_times(cores: set[int], stat: str = "/proc/stat") -> dict[int, tuple[int, int]]:
    """(all time, idle time) in clock ticks of each of ``cores`` since boot, from the kernel's "cpuN" lines."""
    times = {}
    with open(stat, encoding="ascii") as f:
        for line in f:
            name, *fields = line.split()
            if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cores and len(fields) >= 5:
                ticks = [int(x) for x in fields[:8]]  # user nice system idle iowait irq softirq steal
                times[int(name[3:])] = (sum(ticks), ticks[3] + ticks[4])  # waiting for I/O is idle too
    return times


def _available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


class _Progress:
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
            self.bar.set_postfix_str(f"loss {loss:.4f} | {tok_s:,.0f} tok/s | {_duration(left)} left", refresh=False)
        else:
            self.log(f"step {step}/{self.total} | loss {loss:.4f} | lr {lr:.2e} | {tok_s:,.0f} tok/s | "
                     f"{_duration(left)} left")

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


# ----- train --------------------------------------------------------------------------------------


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
    if config is None and not resume:
        raise TinyLMError("a configuration is needed to start a run (only resume can take the run's own)")
    if resume and force:
        raise TinyLMError("--resume continues a run and --force deletes it; choose one")
    if resume and init_from is not None:
        raise TinyLMError("--resume continues a run from its own checkpoint; --init-from starts a new one: choose one")
    out = Path(out_dir)
    data_dir = (config.train.data_dir if config is not None else None)
    if data_dir is not None and Path(data_dir).resolve() == out.resolve():
        raise TinyLMError(f"--data-dir and --out are the same folder ({out}); keep the shards apart from the run "
                          "(e.g. --data-dir data/NAME)")
    if resume and config is not None and (out / CONFIG_FILE).is_file():
        theirs = _family(None, out)
        if theirs != config.model.family:
            raise TinyLMError(f"{out} is a run of {FAMILY_NAMES[theirs]} model, not {FAMILY_NAMES[config.model.family]} "
                              "one; resume it with its own settings (drop --model), or start the new run in another "
                              "--out")
    if _family(config, out) == "ngram":
        from tinylm.train.ngram import count_ngram  # counting, not gradient descent

        return count_ngram(config or Config(), out, resume=resume, force=force, init_from=init_from, log=log)
    ckpt = _checkpoint_to_resume(out, resume) if resume else None
    if ckpt is not None:
        if config is None:
            config = ckpt.config
        else:
            # the vocabulary size is the tokenizer's, whatever the preset's placeholder says
            model = dataclasses.replace(config.model, vocab_size=ckpt.config.model.vocab_size)
            config = dataclasses.replace(config, model=model)
            diffs = config_differences(ckpt.config, config, RESUMABLE_CHANGES | BUDGET_SETTINGS)
            if diffs:
                raise TinyLMError(
                    f"{ckpt.path} was trained with another configuration ({'; '.join(diffs[:3])}); resume with "
                    f"the run's own settings (drop those flags), or start a new run with --out (or --init-from {out})"
                )
    assert config is not None
    check_backends(config.train.log_backends)  # a missing tensorboard or wandb stops the run before it starts
    ctx = Distributed.from_env(config.train.device)
    clean = False
    try:
        threads = config.train.threads
        if threads is None and ctx.device.type == "cpu":
            threads = _default_cpu_threads(ctx.local_world_size)
        with _threads(threads):
            result = _Trainer(config, out, ckpt, ctx, force, init_from, stop_after, progress, log).run()
        clean = True
        return result
    finally:
        ctx.close(clean)


def _family(config: Config | None, out: Path) -> str:
    """The model family of ``config``, or (resuming with the run's own settings) of the run in ``out``."""
    if config is not None:
        return config.model.family
    saved = out / CONFIG_FILE
    if not saved.is_file():
        return "gpt"
    from tinylm.config import build_config, load_config_file

    return build_config(load_config_file(saved)).model.family


def check_new_run_folder(out: Path, force: bool) -> None:
    """A new run may go in ``out``: it is missing or empty, or ``force`` allows replacing the old run there.

    Nothing is deleted here: `clear_run_folder` does that once the data and the model are ready,
    so a mistake found on the way (a missing corpus, a bad setting) leaves the old run intact.
    """
    if out.exists() and not out.is_dir():
        raise TinyLMError(f"--out {out} is a file; a run is a folder: choose another --out")
    blocking = next((p for p in out.parents if p.exists() and not p.is_dir()), None)
    if blocking is not None:
        raise TinyLMError(f"--out {out} cannot be made: {blocking} is a file, not a folder; choose another --out")
    if out.exists() and any(out.iterdir()):
        if not force:
            raise TinyLMError(f"{out} already exists; pass --resume to continue that run, --force to start it "
                              "over (deleting it), or --out to train in another folder")
        if not ((out / RUN_FILE).exists() or (out / CONFIG_FILE).exists()):
            raise TinyLMError(f"{out} is not a tinylm run folder; --force deletes only run folders, so choose "
                              "another --out")


def clear_run_folder(out: Path, keep: Path | None = None) -> None:
    """Delete the old run in ``out`` (checked by `check_new_run_folder`), just before the new one is written.

    ``keep``: the data folder, spared if it lies inside ``out`` (the new run reads it).
    """
    if not out.is_dir():
        return
    keep = keep.resolve() if keep is not None else None
    for entry in out.iterdir():
        if keep is not None and (entry.resolve() == keep or entry.resolve() in keep.parents):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def data_info(shards: ShardSet) -> dict[str, Any]:
    """What run.json records of the data a run learned from: where it is and which text and tokenizer."""
    meta = shards.meta
    return {"dir": str(shards.path.resolve()), "corpus": meta["corpus"], "input_fingerprint": meta["input_fingerprint"],
            "tokenizer_fingerprint": meta["tokenizer"]["fingerprint"]}


def _checkpoint_to_resume(out: Path, resume: bool | str) -> Checkpoint:
    if out.exists() and not out.is_dir():
        raise TinyLMError(f"cannot resume: {out} is a file, not a run folder; give the folder the run was written to")
    if not out.is_dir():
        raise TinyLMError(f"cannot resume: {out} does not exist; start the run without --resume")
    which = "latest" if resume is True else str(resume)
    path = checkpoint_path(out, which) if which in ("latest", "best") else Path(which)
    try:
        return load_checkpoint(path)
    except TinyLMError as e:
        if "no checkpoint at" in str(e):
            raise TinyLMError(f"cannot resume: {out} has no {which} checkpoint yet (it stopped before the first "
                              "one); start it again with --force") from None
        raise


class _Trainer:
    """One call of `train`: the state shared by its phases (set up, steps, evaluation, the end)."""

    def __init__(self, config: Config, out: Path, ckpt: Checkpoint | None, ctx: Distributed, force: bool,
                 init_from: str | os.PathLike | None, stop_after: int | None, progress: bool | None,
                 log: Callable[[str], None]) -> None:
        self.config, self.out, self.ckpt, self.ctx = config, out, ckpt, ctx
        self.tc = config.train
        self.force, self.init_from, self.stop_after = force, init_from, stop_after
        self.log_main: Callable[[str], None] = log if ctx.is_main else (lambda text: None)
        self.progress_enabled = ctx.is_main and progress is not False
        self.show_bar = self.progress_enabled and _is_tty()
        self.device = ctx.device

    # -- set up

    def run(self) -> RunResult:
        init = self._checkpoint_to_init_from()
        if self.ckpt is None:
            self.ctx.main_first(self._check_new_run_folder)
        elif self.ckpt.state.get("world_size", 1) != self.ctx.world_size:
            self.log_main(f"note: resuming with {self.ctx.world_size} processes where the checkpoint had "
                          f"{self.ckpt.state.get('world_size', 1)}; the global batch is the same, but dropout draws "
                          "of new processes start fresh")
        given_tokenizer = (self.ckpt or init).tokenizer if (self.ckpt or init) is not None else None
        self.shards = self._data(given_tokenizer)
        self.tokenizer = self.shards.tokenizer()
        if given_tokenizer is not None and given_tokenizer.fingerprint() != self.tokenizer.fingerprint():
            # prepare_data checks this first; here only as the last guard before training
            raise TinyLMError("the data folder's tokenizer does not match the checkpoint's")
        self.config = dataclasses.replace(
            self.config, model=dataclasses.replace(self.config.model, vocab_size=self.tokenizer.vocab_size))
        self.tc = self.config.train
        if init is not None:
            # the same network, except that dropout and bptt may change for fine-tuning
            # (truncated BPTT changes how gradients flow, not the weights)
            same_family = init.config.model.family == self.config.model.family
            theirs = dataclasses.replace(init.config.model, dropout=self.config.model.dropout,
                                         bptt=self.config.model.bptt if same_family else init.config.model.bptt)
            diffs = config_differences(Config(theirs, self.tc), self.config)
            if diffs:
                raise TinyLMError(f"--init-from {init.path}: that checkpoint is of another model "
                                  f"({'; '.join(diffs[:3])}); use its [model] settings")
        mc = self.config.model
        self.total = total_steps(self.config)
        W = self.ctx.world_size
        if self.tc.batch_size % W:
            raise TinyLMError(f"batch_size {self.tc.batch_size} must divide evenly among {W} processes; "
                              f"use a multiple of {W}")
        self.source = BatchSource(self.shards, mode=self.tc.batch_mode, batch_size=self.tc.batch_size,
                                  block_size=mc.block_size, seed=self.tc.seed, bos_id=self.tokenizer.bos_id,
                                  pad_id=self.tokenizer.pad_id)
        extension = self._extension() if self.ckpt is not None else None
        if self.ckpt is not None and self.ckpt.step >= self.total and (self.out / RUN_FILE).exists():
            info = read_run_info(self.out)
            if info.get("status") == "complete":
                self.log_main(f"{self.out} is already trained: {self.ckpt.step} of {self.total} steps")
                self.step, self.tokens = self.ckpt.step, int(self.ckpt.state.get("tokens", 0))
                self.elapsed_before = float(info.get("elapsed", 0.0))
                return self._result("complete", info.get("train_loss"), info.get("final"), info.get("sample", ""))
        self._build(init)
        self.ctx.main_first(self._write_run_files)
        # process 0 logs the metrics; it opens the backends once the run folder is ready (--force cleared)
        self.metrics = open_metrics_log(self.config, self.out, self.step) if self.ctx.is_main else MetricsLog([])
        try:
            if extension:
                self.log_main(extension)
            self._header()
            with _memory_errors_explained(self.tc, mc.block_size, self.device):
                return self._loop()
        finally:
            self.metrics.close()

    def _extension(self) -> str | None:
        """What resuming with another budget does: None if the budget is the run's own, else a line to log.

        The steps done keep the rates they had. If the longer schedule gives them the same rates (a
        warmup-stable-decay run extended before its decay, a constant rate), the run continues
        bitwise as if the new budget had been asked for from the start; if not (a cosine stretched,
        a decay already begun), the line says from which step the schedules part.
        """
        done, before = self.ckpt.step, total_steps(self.ckpt.config)
        if before == self.total:
            return None
        if self.total < done:
            raise TinyLMError(f"{self.out} has already trained {done:,} steps, more than the {self.total:,} this budget "
                              f"gives; ask for more than {done:,} steps (or the tokens of them) to extend it")
        old_tc = self.ckpt.config.train
        tc = self.tc
        old = [group_lr(old_tc, before, step, old_tc.lr) for step in range(done)]
        new = [self._lr(step, tc.lr) for step in range(done)]
        parted = next((step for step in range(done) if old[step] != new[step]), None)
        head = f"extending the run from {before:,} to {self.total:,} steps ({done:,} done)"
        if parted is None:
            return (f"{head}: the steps done had the learning rates a {self.total:,}-step run gives them, so it "
                    f"continues as if {self.total:,} steps had been asked for from the start")
        return (f"{head}: the {tc.decay} schedule is stretched over the new length, so the steps done from step "
                f"{parted:,} on had other learning rates than a {self.total:,}-step run gives them (step {done - 1:,}: "
                f"{old[done - 1]:.3g}, now {new[done - 1]:.3g}); the rest follow the new schedule")

    def _checkpoint_to_init_from(self) -> Checkpoint | None:
        if self.init_from is None:
            return None
        path = Path(self.init_from)
        if (path / CONFIG_FILE).is_file() and _family(None, path) == "ngram":
            raise TinyLMError(f"{path} is an n-gram run: it has counts, not weights a network can start from; "
                              "give --init-from a run of the same family")
        if (path / RUN_FILE).exists():  # a run folder: its best checkpoint, or its latest if it has none
            best = checkpoint_path(path, "best")
            path = best if has_checkpoint(best) else checkpoint_path(path, "latest")
        init = load_checkpoint(path)
        if self.tc.tokenizer is not None:
            wanted = load_tokenizer(self.tc.tokenizer)
            if wanted.fingerprint() != init.tokenizer.fingerprint():
                raise TinyLMError(
                    f"the tokenizer {self.tc.tokenizer} does not match the one {init.path} was trained with "
                    f"(fingerprints {wanted.fingerprint()} and {init.tokenizer.fingerprint()}); "
                    "drop --tokenizer to use the checkpoint's"
                )
        return init

    def _check_new_run_folder(self) -> None:
        check_new_run_folder(self.out, self.force)

    def _data(self, tokenizer: Tokenizer | None) -> ShardSet:
        tc = self.tc
        if self.ckpt is not None and tc.tokenizer is not None:
            wanted = load_tokenizer(tc.tokenizer)
            if wanted.fingerprint() != self.ckpt.tokenizer.fingerprint():
                raise TinyLMError(
                    f"the tokenizer {tc.tokenizer} does not match the one this run was trained with "
                    f"(fingerprints {wanted.fingerprint()} and {self.ckpt.tokenizer.fingerprint()}); "
                    "resume without --tokenizer"
                )
        reuse_only = False
        if self.ckpt is not None and tc.data_dir is None and (self.out / RUN_FILE).exists():
            # resume from the folder the run trained on, wherever the default would be now; but
            # run.json only names it, so it is read and never written (a user's --data-dir may be)
            recorded = read_run_info(self.out).get("data", {}).get("dir")
            if isinstance(recorded, str) and recorded and Path(recorded).is_dir():
                tc, reuse_only = dataclasses.replace(tc, data_dir=recorded), True
        prepared = self.ctx.main_first(lambda: prepare_data(tc, tokenizer, self.log_main, reuse_only=reuse_only))
        data_dir = self.ctx.agree(str(prepared.path) if prepared is not None else None)
        shards = prepared if prepared is not None else ShardSet.open(data_dir)
        if self.ckpt is not None:
            recorded = read_run_info(self.out).get("data", {}) if (self.out / RUN_FILE).exists() else {}
            if recorded.get("input_fingerprint") not in (None, shards.meta["input_fingerprint"]):
                raise TinyLMError(f"the text in {data_dir} is not the text this run was trained on (the corpus "
                                  "changed); resume with the same corpus, or start a new run")
        return shards

    def _build(self, init: Checkpoint | None) -> None:
        mc, tc, ctx = self.config.model, self.tc, self.ctx
        self.fsdp = ctx.active and tc.parallel == "fsdp"
        torch.manual_seed(tc.seed)  # the same initial weights in every process
        model = build_model(mc)
        if init is not None:
            load_weights(model, init.model_state(), init.path)
        if self.ckpt is not None and not self.fsdp:  # a sharded model loads its shards after sharding
            self.ckpt.load_weights(model)
        model.to(self.device)
        if self.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = True  # float32 matmuls on tensor cores
            torch.backends.cudnn.allow_tf32 = True
        self.model = model
        wrapped = wrap_model(model, tc.parallel, ctx)
        # the fused CUDA AdamW kernel for plain tensors; sharded (DTensor) parameters take the default path
        # the fused AdamW kernel (CUDA, and CPU, where it is 3-5% faster per step than the
        # for-loop version: benchmarks/train.py) for plain tensors; sharded (DTensor)
        # parameters take the default path
        fused = self.device.type in ("cuda", "cpu") and tc.optimizer in ("adamw", "muon") and not self.fsdp
        self.optimizer = make_optimizer(model, tc, fused=fused)
        self.ddp = wrapped if ctx.active and not self.fsdp else None
        self.step_model = torch.compile(wrapped) if tc.compile else wrapped
        # evaluation and sampling skip DDP's gradient hooks; a sharded model must be called as itself
        self.eval_model = self.step_model if self.fsdp else (torch.compile(model) if tc.compile else model)
        self.autocast = _autocast(self.device, tc.dtype)
        # Under bfloat16 autocast on a CPU a Transformer's head and loss run a slice of positions at a
        # time (model/head_loss.py: 0.82x the step time, benchmarks/train_step.py; none of the (B, T, |V|)
        # logits kept). Float32 training keeps the plain head and loss, so its figures stay bit for bit.
        self.head_in_slices = (isinstance(model, GPT) and self.device.type == "cpu"
                               and self.autocast is not contextlib.nullcontext)
        self.step = 0
        self.tokens = 0
        self.elapsed_before = 0.0
        self.best_val_loss = math.inf
        self.best_step: int | None = None
        if self.ckpt is not None:
            self._restore(self.ckpt)
        else:
            torch.manual_seed(_derived_seed(tc.seed, _DROPOUT_STREAM, ctx.rank))

    def _restore(self, ckpt: Checkpoint) -> None:
        state = ckpt.state
        optimizer_state = ckpt.optimizer_state()
        if self.fsdp:
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                set_model_state_dict,
                set_optimizer_state_dict,
            )

            options = StateDictOptions(full_state_dict=True)
            set_model_state_dict(self.model, ckpt.model_state(), options=options)
            if optimizer_state is not None:
                set_optimizer_state_dict(self.model, optimizers_of(self.optimizer), optimizer_state, options=options)
        elif optimizer_state is not None:
            load_named_optimizer_state(self.model, self.optimizer, optimizer_state)
        rng = ckpt.rng_state()
        mine = rng.get(f"torch_cpu/rank{self.ctx.rank}")
        if mine is not None:
            torch.set_rng_state(mine)
        else:
            torch.manual_seed(_derived_seed(self.tc.seed, _DROPOUT_STREAM, self.ctx.rank, ckpt.step))
        cuda = rng.get(f"cuda/rank{self.ctx.rank}")
        if cuda is not None and self.device.type == "cuda":
            torch.cuda.set_rng_state(cuda, self.device)
        self.step = ckpt.step
        self.tokens = int(state.get("tokens", 0))
        self.elapsed_before = float(state.get("elapsed", 0.0))
        self.best_val_loss = float(state.get("best_val_loss") or math.inf)
        self.best_step = state.get("best_step")

    def _write_run_files(self) -> None:
        out = self.out
        if self.ckpt is None and self.force:
            clear_run_folder(out, keep=self.shards.path)
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out / CONFIG_FILE, dump_toml(self.config.to_dict()))
        self.tokenizer.save(out / TOKENIZER_FILE)
        write_run_info(out, {"status": "running", "family": self.config.model.family, "step": self.step,
                             "total_steps": self.total, "data": data_info(self.shards)})
        # lines logged after the checkpoint we resume from describe steps that will be done again
        rows = read_metrics(out / METRICS_FILE)
        write_metrics(out / METRICS_FILE, [r for r in rows if r.get("step", 0) <= self.step])
        self._plot_schedule()

    def _plot_schedule(self) -> None:
        """schedule.png: every optimizer group's rate at every step of the run, known before the first."""
        from tinylm.explain.plots import plot_schedule

        tc = self.tc
        rates: dict[str, list[float]] = {}
        for opt in optimizers_of(self.optimizer):
            kind = type(opt).__name__
            for group in opt.param_groups:
                label = f"{group.get('roles', 'parameters')} ({kind}, peak {group['peak_lr']:.3g})"
                rates[label] = [self._lr(step, group["peak_lr"]) for step in range(self.total)]
        momentum = None
        if tc.optimizer == "muon" and tc.muon_momentum_warmup:
            momentum = [momentum_at(step, momentum=tc.muon_momentum, warmup=tc.muon_momentum_warmup)
                        for step in range(self.total)]
        decay = {"wsd": f"warmup-stable-decay ({tc.decay_shape}, last {tc.decay_fraction:.0%})"}.get(tc.decay, tc.decay)
        plot_schedule(rates, self.out / SCHEDULE_FILE, momentum=momentum,
                      title=f"{self.out.name}: {tc.warmup_steps} warmup steps, then {decay}")

    def _header(self) -> None:
        mc, tc, meta = self.config.model, self.tc, self.shards.meta
        splits = meta["splits"]
        log = self.log_main
        verb = f"resuming at step {self.step} of" if self.ckpt is not None else "training"
        log(f"tinylm train: {verb} run {self.out}")
        log(f"data: {meta['corpus']}, {self.tokenizer.kind} tokenizer |V| = {self.tokenizer.vocab_size}: "
            f"{splits['train']['tokens']:,} training and {splits['val']['tokens']:,} validation tokens "
            f"({self.shards.path}{', reused' if self.shards.reused else ''})")
        log(f"model: {summary(mc)}")
        per_step = tokens_per_step(self.config)
        accum = f" x {tc.grad_accum} micro-batches" if tc.grad_accum > 1 else ""
        decay = f"{tc.decay} to {tc.final_lr:.2e}" if tc.decay != "constant" else "constant"
        if tc.decay == "wsd":
            decay = f"held, then {tc.decay_shape} decay over the last {tc.decay_fraction:.0%} to {tc.final_lr:.2e}"
        rates = ", ".join(f"{g.get('roles', 'all')} {g['peak_lr']:.2e}" for g in self.optimizer.param_groups)
        optimizer = (f"muon (matrices, momentum {tc.muon_momentum:g}) + adamw, lr {rates}" if tc.optimizer == "muon"
                     else f"{tc.optimizer} lr {tc.lr:.2e}")
        log(f"training: {self.total:,} steps of {tc.batch_size}{accum} x {mc.block_size} tokens = {per_step:,} tokens "
            f"({self.total * per_step:,} in all), {optimizer}, {tc.warmup_steps} warmup steps, "
            f"then {decay}; {tc.batch_mode} batches")
        if tc.warmup_steps >= self.total:
            log(f"warning: {tc.warmup_steps} warmup steps for a run of {self.total:,}: the whole run is warmup (the "
                f"rate never decays{'' if tc.warmup_steps == self.total else ' nor reaches its peak'}); "
                f"set --warmup-steps below {self.total:,}")
        procs = f"{self.ctx.world_size} processes ({tc.parallel})" if self.ctx.active else "1 process"
        threads = torch.get_num_threads()
        log(f"device: {self.device}, {_precision_name(self.device, tc.dtype)}, {procs}, "
            f"{threads} CPU thread{'s' if threads > 1 else ''} each{', compiled' if tc.compile else ''}")
        if len(self.metrics.sinks) > 1:  # --log-to: metrics.jsonl and where else they go
            log(f"metrics: {'; '.join(self.metrics.where)}")

    # -- the steps

    def _train_step(self, step: int) -> tuple[torch.Tensor, int, torch.Tensor]:
        """One optimizer step; returns this process's summed loss, the step's target count, the gradient norm."""
        tc, W = self.tc, self.ctx.world_size
        # the whole step's batch is drawn in every process (only token ids: cheap), so all agree on
        # the number of targets; each then computes on its own rows
        batch = self.source.step_batch(step, tc.grad_accum)
        n_targets = batch.n_targets
        if n_targets == 0:
            raise TinyLMError(f"step {step + 1} has no targets to learn from; check the data")
        micro = micro_batches(batch, tc.batch_size, self.ctx.rank, W)
        loss_sum = torch.zeros((), device=self.device)
        for i, mb in enumerate(micro):
            x, y, mask = mb.to(self.device)
            last = i == tc.grad_accum - 1
            with self._gradient_sync(last):
                if self.head_in_slices:
                    with self.autocast():
                        _, nll = self.step_model(x, targets=y, attention_mask=mask, reduction="sum",
                                                 return_logits=False)
                else:
                    with self.autocast():
                        logits, _ = self.step_model(x, attention_mask=mask)  # (B, T, |V|)
                    nll = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=IGNORE_INDEX,
                                          reduction="sum")
                (nll * (W / n_targets)).backward()  # DDP divides by W when it averages gradients
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
        return loss_sum, n_targets, norm.detach()

    def _gradient_sync(self, sync: bool) -> contextlib.AbstractContextManager:
        """Average gradients across processes only on the last micro-batch: accumulation needs no traffic."""
        if self.fsdp:
            self.model.set_requires_gradient_sync(sync)
            return contextlib.nullcontext()
        if self.ddp is not None and not sync:
            return self.ddp.no_sync()
        return contextlib.nullcontext()

    def _check(self, pending: list[tuple[int, torch.Tensor, int, torch.Tensor, float]]) -> list[float]:
        """The global mean loss of each pending step; stops the run at the first non-finite one."""
        sums = self.ctx.all_reduce_sum(torch.stack([p[1] for p in pending]).double())
        norms = torch.stack([p[3].float() for p in pending]).cpu()
        losses = [float(s) / p[2] for s, p in zip(sums.cpu(), pending)]
        for (step, _, _, _, lr), loss, norm in zip(pending, losses, norms.tolist()):
            if not (math.isfinite(loss) and math.isfinite(norm)):
                what = (f"the training loss became {loss}" if not math.isfinite(loss)
                        else f"the gradient norm became {norm}")
                latest = checkpoint_path(self.out, "latest")
                kept = (f"the last good checkpoint, {latest} (step {self.saved_step}), is kept"
                        if self.saved_step is not None else "no checkpoint had been saved yet")
                raise TinyLMError(
                    f"{what} at step {step + 1} (lr {lr:.3g}); stopped without saving it: {kept}. Lower lr (now "
                    f"{self.tc.lr:g}), keep grad_clip on, then start again with --force "
                    "(or --resume from the checkpoint)"
                )
        return losses

    def _loop(self) -> RunResult:
        tc, out = self.tc, self.out
        self.saved_step: int | None = self.ckpt.step if self.ckpt is not None else None
        ckpt_every = tc.checkpoint_interval or tc.eval_interval
        stop = self.total if self.stop_after is None else min(self.total, max(self.stop_after, self.step))
        per_step = tokens_per_step(self.config)
        progress = _Progress(self.total, self.step, self.log_main, self.progress_enabled, self.show_bar)
        self.started = time.perf_counter()
        pending: list[tuple[int, torch.Tensor, int, torch.Tensor, float]] = []
        last_loss: float | None = None
        window_start, window_tokens = time.perf_counter(), 0
        self.model.train()
        try:
            while self.step < stop:
                step = self.step
                lr = self._lr(step, tc.lr)
                set_schedule(self.optimizer, lambda peak: self._lr(step, peak),
                             momentum_at(step, momentum=tc.muon_momentum, warmup=tc.muon_momentum_warmup))
                loss_sum, n_targets, norm = self._train_step(step)
                pending.append((step, loss_sum, n_targets, norm, lr))
                self.step += 1
                self.tokens += per_step
                window_tokens += per_step
                done = self.step
                do_eval = done % tc.eval_interval == 0 and done < self.total
                do_save = done % ckpt_every == 0 or done == stop
                if done % tc.log_interval == 0 or do_eval or do_save or done == self.total:
                    losses = self._check(pending)
                    now = time.perf_counter()
                    tok_s = window_tokens / max(now - window_start, 1e-9)
                    last_loss = sum(losses) / len(losses)
                    rate = (now - self.started) / max(done - (self.ckpt.step if self.ckpt else 0), 1)
                    left = rate * (self.total - done)
                    self._metrics({"kind": "train", "step": done, "loss": last_loss, "lr": lr, "tokens": self.tokens,
                                   "tokens_per_s": tok_s, "grad_norm": float(pending[-1][3]),
                                   "elapsed": self._elapsed()})
                    progress.update(done, len(pending), last_loss, lr, tok_s, left)
                    pending, window_start, window_tokens = [], now, 0
                improved = False
                if do_eval:
                    val = self._evaluate(tc.eval_tokens)
                    progress.write(self._eval_line(done, val))
                    self._metrics({"kind": "eval", "step": done, **val.as_dict(), "elapsed": self._elapsed()})
                    improved = self._note_val_loss(val.loss)
                if do_save and done < self.total:
                    self._save_latest()
                if improved:
                    self._save_best(saved_now=do_save and done < self.total)
                if do_eval or do_save:
                    window_start = time.perf_counter()  # evaluating and saving are not training speed
        finally:
            progress.close()
        if self.step < self.total:
            self._update_run_info("stopped", last_loss)
            self.log_main(f"stopped after step {self.step} of {self.total}; continue with --resume. "
                          f"Checkpoint: {checkpoint_path(out, 'latest')}")
            return self._result("stopped", last_loss, None, "")
        return self._finish(last_loss)

    def _lr(self, step: int, peak: float) -> float:
        return group_lr(self.tc, self.total, step, peak)

    # -- evaluation, checkpoints, the end

    def _evaluate(self, max_tokens: int) -> EvalResult:
        # On a CPU, evaluation stays in float32 whatever training runs in: it is a small part of the
        # time, and the figure printed is then the one `tinylm eval` gives for the same weights.
        autocast = self.autocast if self.device.type != "cpu" else contextlib.nullcontext
        return evaluate(self.eval_model, self.shards, "val", block_size=self.config.model.block_size,
                        batch_size=self.tc.eval_batch_size or self.tc.batch_size, max_tokens=max_tokens,
                        device=self.device, autocast=autocast, rank=self.ctx.rank,
                        world_size=self.ctx.world_size)

    def _eval_line(self, step: int, val: EvalResult) -> str:
        scope = (f"{val.tokens:,} of {self.shards.num_tokens('val'):,} tokens, bytes prorated" if val.prorated
                 else f"the whole validation split, {val.tokens:,} tokens")
        scope += f", {val.describe_windows()}"
        unknown = f"; {val.unknown_tokens:,} <unk> tokens charged 8 bits a byte" if val.unknown_tokens else ""
        return (f"step {step}: val loss {val.loss:.4f}, perplexity {val.perplexity:.2f}, "
                f"{val.bits_per_byte:.4f} bits per byte ({scope}{unknown})")

    def _elapsed(self) -> float:
        return self.elapsed_before + time.perf_counter() - self.started

    def _metrics(self, row: dict[str, Any]) -> None:
        self.metrics.log(row)

    def _state_dicts(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        if self.fsdp:
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                get_model_state_dict,
                get_optimizer_state_dict,
            )

            # every process takes part in gathering the shards; process 0 receives them
            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            return (get_model_state_dict(self.model, options=options),
                    get_optimizer_state_dict(self.model, optimizers_of(self.optimizer), options=options))
        return self.model.state_dict(), named_optimizer_state(self.model, self.optimizer)

    def _rng_state(self) -> dict[str, torch.Tensor]:
        states = {f"torch_cpu/rank{r}": t for r, t in enumerate(self.ctx.all_gather(torch.get_rng_state()))}
        if self.device.type == "cuda":
            cuda = self.ctx.all_gather(torch.cuda.get_rng_state(self.device))
            states.update({f"cuda/rank{r}": t for r, t in enumerate(cuda)})
        return states

    def _save(self, name: str) -> Path:
        model_state, optimizer_state = self._state_dicts()
        rng = self._rng_state()
        path = checkpoint_path(self.out, name)
        if self.ctx.is_main:
            save_checkpoint(path, model_state=model_state, optimizer_state=optimizer_state, rng_state=rng,
                            config=self.config, tokenizer=self.tokenizer, state={
                                "step": self.step,
                                "total_steps": self.total,
                                "tokens": self.tokens,
                                "elapsed": self._elapsed(),
                                "best_val_loss": None if math.isinf(self.best_val_loss) else self.best_val_loss,
                                "best_step": self.best_step,
                                "world_size": self.ctx.world_size,
                                "data": {"mode": self.tc.batch_mode, "seed": self.tc.seed, "next_step": self.step,
                                         "how": "micro-batch i of step s is drawn with numpy "
                                                "default_rng([seed, s, i]): the position in the data is the step"},
                                "rng": {"torch": "rng.safetensors: torch_cpu/rank<r> (and cuda/rank<r>), each "
                                                 "process's torch random state (dropout)",
                                        "numpy": "none kept: batches are a function of (seed, step)",
                                        "python": "random is not used"},
                            })
        self.ctx.barrier()
        return path

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
        if not self.ctx.is_main:
            return
        info = read_run_info(self.out)
        info.update({"status": status, "step": self.step, "total_steps": self.total, **extra})
        if train_loss is not None:
            info["train_loss"] = train_loss
        info.pop("format", None)
        info.pop("version", None)
        write_run_info(self.out, info)

    def _finish(self, last_loss: float | None) -> RunResult:
        tc, out = self.tc, self.out
        final = self._evaluate(tc.final_eval_tokens)
        # the best checkpoint is chosen on the same windows as every periodic evaluation
        n_val = self.shards.num_tokens("val")
        periodic = window_starts(n_val, self.config.model.block_size, tc.eval_tokens)
        if np.isin(periodic, final.window_starts).all():
            comparable = restrict(final, periodic, n_val, self.shards.meta["splits"]["val"]["bytes"])
        else:
            comparable = self._evaluate(tc.eval_tokens)
        self._metrics({"kind": "eval", "step": self.step, **comparable.as_dict(), "elapsed": self._elapsed()})
        self._metrics({"kind": "final", "step": self.step, **final.as_dict(), "elapsed": self._elapsed()})
        improved = self._note_val_loss(comparable.loss)
        self._save_latest()
        if improved:
            self._save_best(saved_now=True)
        plot = None
        if self.ctx.is_main:
            from tinylm.explain.plots import plot_loss_curve

            plot = plot_loss_curve(read_metrics(out / METRICS_FILE), out / PLOT_FILE,
                                   title=f"{out.name}: {final.bits_per_byte:.3f} bits per byte on validation")
        sample = self._sample()
        val = {"loss": final.loss, "perplexity": final.perplexity, "bits_per_byte": final.bits_per_byte,
               "tokens": final.tokens, "prorated": final.prorated}
        self._update_run_info("complete", last_loss, final=val, sample=sample, elapsed=self._elapsed(),
                              best_step=self.best_step)
        log = self.log_main
        log(self._eval_line(self.step, final))
        elapsed = self._elapsed()
        log(f"trained {self.step:,} steps in {_duration(elapsed)} ({self.tokens:,} tokens, "
            f"{self.tokens / max(elapsed, 1e-9):,.0f} tokens/s overall)")
        log(f"checkpoint: {checkpoint_path(out, 'latest')} "
            f"(best: {checkpoint_path(out, 'best')}, step {self.best_step})")
        if plot is not None:
            log(f"loss curve: {plot}")
        if tc.sample_tokens:
            log(f"sample ({tc.sample_tokens} tokens at most, temperature {tc.sample_temperature:g}"
                f"{f', top-k {tc.sample_top_k}' if tc.sample_top_k else ''}):")
            log(sample)
        result = self._result("complete", last_loss, val, sample)
        result.plot = plot
        return result

    def _sample(self) -> str:
        tc = self.tc
        if not tc.sample_tokens:
            return ""
        # every process samples (a sharded model needs all of them for each forward pass); the same
        # seed gives each the same text
        params = SamplingParams(max_new_tokens=tc.sample_tokens, temperature=tc.sample_temperature,
                                top_k=tc.sample_top_k or None, seed=tc.seed)
        model = self.eval_model if self.fsdp else self.model
        with warnings.catch_warnings():  # a sample longer than the context slides its window; expected here
            warnings.simplefilter("ignore", UserWarning)
            (completion,) = reference_generate(model, [start_ids(self.config, self.tokenizer)], params, self.tokenizer)
        return completion.text

    def _result(self, status: str, train_loss: float | None, val: dict[str, Any] | None, sample: str) -> RunResult:
        best = checkpoint_path(self.out, "best")
        plot = self.out / PLOT_FILE
        return RunResult(self.out, status, self.step, self.total, self.tokens, train_loss, val,
                         checkpoint_path(self.out, "latest"), best if best.exists() else None,
                         plot if plot.exists() else None, sample,
                         self.elapsed_before + (time.perf_counter() - self.started if hasattr(self, "started") else 0))

