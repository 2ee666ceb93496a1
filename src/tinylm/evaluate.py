"""Evaluation: a language model's loss, perplexity and bits per byte on a split of token shards.

Every token of the split is a target exactly once, in windows of ``block_size`` (or sliding
windows with a ``stride``), for every model family: Transformers, RNNs and LSTMs the same way,
n-gram models by their own scorer. Bits per byte (N * loss / (B ln 2), plus 8 bits per byte an
``<unk>`` stands for) is the number that compares models with different tokenizers. A
``max_tokens`` budget evaluates evenly spaced windows and prorates the bytes; under ``torchrun``
the processes share the windows. docs/evaluation.md has the formulas and why each choice.

Usage::

    result = evaluate(model, shards, "val", block_size=256, batch_size=32)
    print(result.loss, result.perplexity, result.bits_per_byte)
    result = evaluate(model, shards, "val", block_size=256, stride=64)   # sliding windows
    result = evaluate_run("runs/tiny-shakespeare")          # a trained run, on its own data
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor
from tqdm import tqdm

from tinylm.data.chat_shards import chat_arrays, chat_rows
from tinylm.data.corpora import Corpus, load_corpus
from tinylm.data.shards import ShardSet
from tinylm.device import use_threads
from tinylm.errors import TinyLMError
from tinylm.model import IGNORE_INDEX, NGramLM
from tinylm.model.eval_result import EvalResult
from tinylm.model.head_loss import next_token_loss
from tinylm.run import load_run
from tinylm.tokenizers.base import Tokenizer, check_same_tokenizer


def unknown_pieces(tokens: np.ndarray, n_bytes: int, tokenizer: Tokenizer | None) -> tuple[int, int]:
    """(<unk> tokens, the UTF-8 bytes they stand for) in a token stream whose text is ``n_bytes`` long."""
    unk = getattr(tokenizer, "unk_id", None)
    if unk is None:
        return 0, 0
    tokens = np.asarray(tokens)
    n_unk = int(np.count_nonzero(tokens == unk))
    if n_unk == 0:
        return 0, 0
    lengths = np.array([0 if i == unk or tokenizer.is_special(i) else len(tokenizer.token_bytes(i))
                        for i in range(tokenizer.vocab_size)], dtype=np.int64)
    return n_unk, max(int(n_bytes) - int(lengths[tokens].sum()), 0)


def check_stride(stride: int | None, block_size: int | None, whose: str = "") -> int | None:
    """The step between window starts: ``block_size`` (disjoint windows) for None, else ``stride``, which must be
    1..block_size. ``block_size`` None is a model without windows (an n-gram): any positive stride is accepted
    and none is used. ``whose`` names the run in the error ("of runs/quick")."""
    if block_size is None:
        if stride is not None and stride < 1:
            raise TinyLMError(f"stride {stride} is out of range: give a positive integer (an n-gram model{whose} "
                              "has no windows, so every stride scores it the same)")
        return None
    if stride is None:
        return block_size
    if not (isinstance(stride, (int, np.integer)) and 1 <= stride <= block_size):
        raise TinyLMError(f"stride {stride} is out of range: give 1 to {block_size}, the block_size{whose} "
                          f"(stride {block_size} is disjoint windows)")
    return int(stride)


def window_size(model: object, block_size: int) -> int | None:
    """The length of the windows ``model`` is evaluated in: ``block_size``, or None for an n-gram model."""
    return None if isinstance(model, NGramLM) else block_size


def window_starts(n_tokens: int, block_size: int, max_tokens: int = 0, *, stride: int | None = None) -> np.ndarray:
    """First target index of each window to evaluate: all of them, or evenly spaced ones within a budget.

    Windows start at multiples of ``stride`` (default ``block_size``: disjoint windows) and hold up to
    ``block_size`` targets; the last one reaches the end of the split (see `window_spans` for what each
    scores). With ``max_tokens`` > 0 and fewer tokens than the split, ceil(max_tokens / stride) of the
    windows that score exactly ``stride`` targets are chosen, spread evenly over the split (always the
    same ones for the same split and sizes): the full windows, less window 0 of a sliding evaluation
    (it scores all block_size of its targets, most with less context than the others).
    """
    stride = check_stride(stride, block_size)
    # window j ends at min(j*S + block_size, n): the last one is the first to reach the end
    starts = stride * np.arange(math.ceil(max(n_tokens - block_size, 0) / stride) + 1)
    if max_tokens <= 0 or max_tokens >= n_tokens:
        return starts
    even = np.flatnonzero((starts + block_size <= n_tokens) & ((starts > 0) | (stride == block_size)))
    if len(even) == 0:  # a split shorter than one window (plus a stride): all of it is the only sample
        return starts
    wanted = min(math.ceil(max_tokens / stride), len(even))
    return starts[even[np.unique(np.linspace(0, len(even) - 1, wanted).round().astype(np.int64))]]


def window_spans(starts: np.ndarray, n_tokens: int, block_size: int, stride: int | None = None
                 ) -> tuple[np.ndarray, np.ndarray]:
    """For windows starting at ``starts`` (`window_starts`): how many targets each holds, and how many of its
    first targets it skips because the window before it scored them.

    Window j (start j*S) holds the targets j*S .. min(j*S + block_size, n) - 1; window j - 1 ended at
    (j-1)*S + block_size, so the first block_size - S are already scored, and window 0 skips none. The
    windows' scored targets then tile the split: every target once.
    """
    stride = check_stride(stride, block_size)
    lengths = np.minimum(block_size, n_tokens - starts)
    skips = np.where(starts == 0, 0, block_size - stride)
    return lengths, skips


def _window(data: np.ndarray, start: int, length: int, context: int) -> tuple[np.ndarray, np.ndarray]:
    """Inputs and targets for the targets data[start:start+length]: the inputs are the tokens one before."""
    y = np.asarray(data[start : start + length], dtype=np.int64)
    if start == 0:
        x = np.concatenate(([context], np.asarray(data[: length - 1], dtype=np.int64)))
    else:
        x = np.asarray(data[start - 1 : start + length - 1], dtype=np.int64)
    return x, y


def evaluate(
    model: torch.nn.Module | Callable[[Tensor], Tensor | tuple[Tensor, ...]],
    shards: ShardSet,
    split: str = "val",
    **kwargs: Any,
) -> EvalResult:
    """Loss, perplexity and bits per byte of ``model`` on ``split`` of ``shards`` (see `evaluate_tokens`)."""
    data = shards.tokens(split)
    if len(data) == 0:
        raise TinyLMError(f"the {split} split of {shards.path} is empty; "
                          "prepare the data with a larger validation share")
    return evaluate_tokens(model, data, shards.meta["splits"][split]["bytes"], shards.eos_id, split=split,
                           tokenizer=shards.tokenizer(), **kwargs)


# Windows per forward pass when the caller does not choose: about this many tokens, whatever the
# run's training batch. On the tiny preset (2 CPU threads) 256-4096 tokens a batch run at the same
# speed within noise and 8192 is slower (`benchmarks/eval_speed.py`); smaller batches keep the
# logits of a large vocabulary (B x T x |V| floats) small.
EVAL_BATCH_TOKENS = 1024


def eval_batch_size(block_size: int) -> int:
    """The default number of windows per forward pass: `EVAL_BATCH_TOKENS` tokens, at least one window."""
    return max(1, EVAL_BATCH_TOKENS // block_size)


def evaluate_tokens(
    model: torch.nn.Module | Callable[[Tensor], Tensor | tuple[Tensor, ...]],
    data: np.ndarray,
    split_bytes: int,
    eos_id: int,
    *,
    block_size: int,
    split: str = "val",
    batch_size: int = 32,
    max_tokens: int = 0,
    stride: int | None = None,
    device: torch.device | str = "cpu",
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    rank: int = 0,
    world_size: int = 1,
    tokenizer: Tokenizer | None = None,
    progress: bool = False,
) -> EvalResult:
    """Loss, perplexity and bits per byte of ``model`` on a token stream (see the module docstring).

    ``data`` holds the documents' tokens back to back, each followed by EOS (``eos_id``), and
    stands for ``split_bytes`` UTF-8 bytes of text. ``model(x)`` takes token ids (B, T) and
    returns logits (B, T, |V|), or a tuple whose first element is the logits (as `GPT` does).
    ``max_tokens`` > 0 evaluates evenly spaced windows within that budget instead of everything.
    ``stride`` (1..block_size) evaluates in sliding windows that start every ``stride`` targets, each
    target scored once with at least block_size - stride + 1 tokens of context; None (or block_size)
    is disjoint windows.
    ``autocast`` is a context manager factory for mixed precision. With ``world_size`` > 1
    (inside an initialised process group) each process takes every world_size-th batch and the
    sums are all-reduced. ``tokenizer`` (the stream's) lets bits per byte charge ``<unk>`` tokens
    for the bytes they stand for. ``progress`` shows a bar of the windows done on stderr.
    """
    if batch_size < 1:
        raise TinyLMError(f"batch_size must be positive, got {batch_size}")
    started = time.perf_counter()
    device = torch.device(device)
    if len(data) == 0:
        raise TinyLMError("there are no tokens to evaluate")
    stride = check_stride(stride, block_size)
    plan = _plan_windows(len(data), block_size, batch_size, max_tokens, stride)
    with _eval_mode(model), tqdm(total=len(plan.starts), desc=f"evaluating {split}", unit="window",
                                 disable=not progress, leave=False) as bar:
        losses = _score_windows(model, data, plan, eos_id, device, autocast, rank, world_size, bar.update)
    return _windowed_result(split, data, split_bytes, tokenizer, plan, losses, started, block_size, stride)


@dataclass
class _WindowPlan:
    """The windows an evaluation reads (`window_starts`, `window_spans`), and the batches they are read in."""

    starts: np.ndarray  # each window's first target
    lengths: np.ndarray  # the targets it holds
    skips: np.ndarray  # how many of its first targets the window before scored
    batches: list[np.ndarray]  # indices into the windows, one forward pass each

    @property
    def scored(self) -> np.ndarray:
        """The targets each window scores: every target of the evaluated text once over all of them."""
        return (self.lengths - self.skips).astype(np.int64)


def _plan_windows(n_tokens: int, block_size: int, batch_size: int, max_tokens: int, stride: int) -> _WindowPlan:
    starts = window_starts(n_tokens, block_size, max_tokens, stride=stride)
    lengths, skips = window_spans(starts, n_tokens, block_size, stride)
    # full windows in batches, the one short tail window (if evaluated) as a batch of its own
    full = np.flatnonzero(lengths == block_size)
    batches = [full[i : i + batch_size] for i in range(0, len(full), batch_size)]
    batches += [np.array([i]) for i in np.flatnonzero(lengths < block_size)]
    return _WindowPlan(starts, lengths, skips, batches)


@contextlib.contextmanager
def _eval_mode(model: object) -> Iterator[None]:
    """``model`` in eval mode (no dropout) inside the block, back in training mode after it if it was."""
    was_training = getattr(model, "training", False)
    if isinstance(model, torch.nn.Module):
        model.eval()
    try:
        yield
    finally:
        if was_training and isinstance(model, torch.nn.Module):
            model.train()


def _score_windows(
    model: torch.nn.Module | Callable[[Tensor], Tensor | tuple[Tensor, ...]],
    data: np.ndarray,
    plan: _WindowPlan,
    context: int,
    device: torch.device,
    autocast: Callable[[], contextlib.AbstractContextManager],
    rank: int,
    world_size: int,
    done: Callable[[int], object],
) -> np.ndarray:
    """Each window's summed -log p of the targets it scores (nats, float64), in the plan's order; ``context``
    is the token read before the text's first. This process scores its share of the batches (`_my_batches`),
    telling ``done`` how many windows each finished; with ``world_size`` > 1 the sums are all-reduced."""
    losses = torch.zeros(len(plan.starts), dtype=torch.float64, device=device)  # per window, nats
    # inference mode skips autograd's bookkeeping altogether; a sharded model's collectives (FSDP
    # inside training) keep to no_grad, which they are written for
    no_autograd = torch.inference_mode() if world_size == 1 else torch.no_grad()
    with no_autograd:
        for index, keep in _my_batches(plan.batches, rank, world_size):
            x, y = _batch(data, plan, index, context, device)
            with autocast():
                out = model(x)
            logits = out[0] if isinstance(out, tuple) else out  # (B, T, |V|)
            nll = next_token_loss(logits.float(), y, reduction="none")  # (B*T,), 0 where masked
            if keep:
                losses[torch.from_numpy(index).to(device)] = nll.view(len(index), -1).double().sum(dim=1)
                done(len(index))
    if world_size > 1:
        import torch.distributed as dist

        dist.all_reduce(losses)  # each window was filled in by exactly one process, zeros elsewhere
    return losses.cpu().numpy()


def _my_batches(batches: list[np.ndarray], rank: int, world_size: int) -> Iterator[tuple[np.ndarray, bool]]:
    """(windows, keep) for each forward pass of process ``rank``: every world_size-th batch from its own.

    Every process runs the same number of forward passes (a sharded model needs all of them for each
    one): when the batches do not divide evenly, some repeat batch 0 and discard it (keep False).
    """
    for k in range(math.ceil(len(batches) / world_size)):
        b = k * world_size + rank
        yield (batches[b], True) if b < len(batches) else (batches[0], False)


def _batch(data: np.ndarray, plan: _WindowPlan, index: np.ndarray, context: int, device: torch.device
           ) -> tuple[Tensor, Tensor]:
    """Inputs x (B, T) and targets y (B, T) of the windows ``index``; a target another window scores is masked."""
    pairs = [_window(data, int(plan.starts[i]), int(plan.lengths[i]), context) for i in index]
    x = torch.from_numpy(np.stack([p[0] for p in pairs])).to(device)  # (B, T)
    y = np.stack([p[1] for p in pairs])  # (B, T)
    for row, i in enumerate(index):
        y[row, : plan.skips[i]] = IGNORE_INDEX  # scored by the window before (sliding windows only)
    return x, torch.from_numpy(y).to(device)  # (B, T), (B, T)


def evaluate_chats(
    model: torch.nn.Module | Callable[[Tensor], Tensor | tuple[Tensor, ...]],
    shards: ShardSet,
    split: str = "val",
    *,
    block_size: int,
    batch_size: int = 32,
    device: torch.device | str = "cpu",
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> EvalResult:
    """Loss, perplexity and bits per byte of ``model`` on what the assistant writes in a conversation split
    (`tinylm.data.chat_shards`): each conversation one row, as fine-tuning reads it, and only the trained targets
    scored, so the figure is the fine-tuning loss on held-out chats. Bits per byte divide by the bytes of those
    targets. Every process scores every conversation (a split of chats is small)."""
    started = time.perf_counter()
    device = torch.device(device)
    tokens, trained, offsets = chat_arrays(shards, split)
    tokenizer = shards.tokenizer()
    n = len(offsets) - 1
    if n == 0:
        raise TinyLMError(f"the {split} split of {shards.path} has no conversations")
    losses, counts, n_bytes = np.zeros(n), np.zeros(n, dtype=np.int64), 0
    with _eval_mode(model), torch.no_grad():
        for first in range(0, n, batch_size):
            chats = np.arange(first, min(first + batch_size, n))
            x, y, mask = chat_rows(tokens, trained, offsets, chats, block_size, tokenizer.pad_id, IGNORE_INDEX)
            with autocast():
                out = model(torch.from_numpy(x).to(device), attention_mask=torch.from_numpy(mask).to(device))
            logits = out[0] if isinstance(out, tuple) else out  # (B, T, |V|)
            nll = next_token_loss(logits.float(), torch.from_numpy(y).to(device), reduction="none")
            losses[chats] = nll.view(len(chats), -1).double().sum(dim=1).cpu().numpy()
            counts[chats] = (y != IGNORE_INDEX).sum(axis=1)
            # the text the scored targets stand for (the end-of-turn token stands for none)
            n_bytes += sum(len(tokenizer.token_bytes(t)) for t in y[y != IGNORE_INDEX].tolist()
                           if not tokenizer.is_special(t))
    return EvalResult(split, float(losses.sum()), int(counts.sum()), float(max(n_bytes, 1)), False, np.arange(n),
                      losses, counts, seconds=time.perf_counter() - started, block_size=block_size, stride=block_size,
                      scope=f"what the assistant writes in {n:,} held-out chats, one chat a row")


def _prorated_bytes(split_bytes: int, tokens: int, n_split_tokens: int) -> tuple[bool, float]:
    """(whether ``tokens`` are only part of the split, the bytes they stand for: the split's share of them)."""
    prorated = tokens != n_split_tokens
    return prorated, split_bytes * tokens / n_split_tokens if prorated else float(split_bytes)


def _windowed_result(split: str, data: np.ndarray, split_bytes: int, tokenizer: Tokenizer | None,
                     plan: _WindowPlan, window_losses: np.ndarray, started: float, block_size: int, stride: int
                     ) -> EvalResult:
    """The sums over the windows of ``plan``, bytes and <unk> pieces prorated when they are not the whole text."""
    scored = plan.scored  # targets per window
    tokens = int(scored.sum())
    prorated, n_bytes = _prorated_bytes(split_bytes, tokens, len(data))
    n_unk, unk_bytes = unknown_pieces(data, split_bytes, tokenizer)
    share = tokens / len(data)
    return EvalResult(split, float(window_losses.sum()), tokens, n_bytes, prorated,
                      plan.starts, window_losses, scored, time.perf_counter() - started,
                      round(n_unk * share), unk_bytes * share, block_size, stride)


def restrict(result: EvalResult, starts: np.ndarray, n_split_tokens: int, split_bytes: int) -> EvalResult:
    """The result over a subset of its windows (those starting at ``starts``), bytes prorated."""
    keep = np.isin(result.window_starts, starts)
    if keep.sum() != len(starts):
        raise TinyLMError("those windows were not all evaluated")
    tokens = int(result.window_tokens[keep].sum())
    prorated, n_bytes = _prorated_bytes(split_bytes, tokens, n_split_tokens)
    share = tokens / result.tokens  # the unknown pieces, prorated like the bytes
    return EvalResult(result.split, float(result.window_losses[keep].sum()), tokens, n_bytes, prorated,
                      result.window_starts[keep], result.window_losses[keep], result.window_tokens[keep],
                      result.seconds, round(result.unknown_tokens * share), result.unknown_bytes * share,
                      result.block_size, result.stride)


@dataclass
class EvalText:
    """The text an evaluation reads: token ids (documents back to back, each ending in EOS) and its size."""

    name: str  # "val", "train", or the corpus
    tokens: np.ndarray
    bytes: int  # UTF-8 bytes of the documents' text


def corpus_text(corpus: str | Corpus, tokenizer: Tokenizer) -> EvalText:
    """Any corpus `tinylm.data.load_corpus` reads (or its name), tokenized with ``tokenizer`` the way shards are."""
    if not isinstance(corpus, Corpus):
        corpus = load_corpus(corpus)
    ids: list[int] = []
    n_bytes = 0
    for text in corpus.texts():
        ids += tokenizer.encode(text)
        ids.append(tokenizer.eos_id)
        n_bytes += len(text.encode("utf-8"))
    if not ids:
        raise TinyLMError(f"the corpus {corpus.name} holds no text to evaluate on")
    return EvalText(corpus.name, np.asarray(ids, dtype=np.int64), n_bytes)


def split_text(shards: ShardSet, split: str) -> EvalText:
    return EvalText(split, shards.tokens(split), int(shards.meta["splits"][split]["bytes"]))


def evaluate_model(
    model: torch.nn.Module,
    text: EvalText,
    tokenizer: Tokenizer,
    *,
    block_size: int,
    batch_size: int | None = None,
    max_tokens: int = 0,
    stride: int | None = None,
    device: str = "cpu",
    progress: bool = False,
    start_id: int | None = None,
) -> EvalResult:
    """Evaluate any family: a network (`GPT`, `RecurrentLM`) by windows, an n-gram (`NGramLM`) by its own scorer.

    ``start_id`` is the token the text's first token is read after (a run's last `start_ids`: the BOS an
    imported tokenizer puts first); None is EOS, the separator every later document follows too.

    The n-gram model scores the whole text in a few vectorised passes, its context restarting
    after each EOS as in counting (``max_tokens`` does not apply: it is fast enough for all of it;
    ``stride`` changes nothing, every target already has its whole n-gram context). ``batch_size``
    None: `eval_batch_size` windows a forward pass.
    """
    check_stride(stride, window_size(model, block_size))
    if len(text.tokens) == 0:
        raise TinyLMError(f"the {text.name} text is empty: there is nothing to evaluate")
    if isinstance(model, NGramLM):
        started = time.perf_counter()
        result = model.ngram.evaluate(text.tokens, text.bytes, split=text.name)
        n_unk, unk_bytes = unknown_pieces(text.tokens, text.bytes, tokenizer)
        return dataclasses.replace(result, seconds=time.perf_counter() - started, unknown_tokens=n_unk,
                                   unknown_bytes=unk_bytes)
    first = tokenizer.eos_id if start_id is None else start_id
    return evaluate_tokens(model, text.tokens, text.bytes, first, split=text.name, block_size=block_size,
                           batch_size=batch_size or eval_batch_size(block_size), max_tokens=max_tokens,
                           stride=stride, device=device, tokenizer=tokenizer, progress=progress)


def check_split_or_corpus(split: str, corpus: object, *, runs: str = "the run's") -> None:
    """A split of the shards, or a whole corpus: asking for both is a mistake, not a choice of one."""
    if corpus is not None and split != "val":
        raise TinyLMError(f"--split picks a split of {runs} shards; --corpus evaluates on a whole corpus instead "
                          "(split= and corpus= from Python)")


def evaluate_run(
    run_dir: str | os.PathLike,
    split: str = "val",
    *,
    checkpoint: str = "best",
    max_tokens: int = 0,
    stride: int | None = None,
    batch_size: int | None = None,
    data_dir: str | None = None,
    corpus: str | Corpus | None = None,
    tokenizer: str | None = None,
    device: str = "cpu",
    progress: bool = False,
    threads: int | None = None,
    log: Callable[[str], None] | None = None,
    quant: str | None = None,
) -> EvalResult:
    """Evaluate a trained run of any family (`tinylm.run.load_run`), or an n-gram model file (.npz).

    On ``split`` of the shards the run was trained on (``data_dir`` if they have moved; they must
    have been made with the run's tokenizer), or on any ``corpus`` (a name or path, as for
    training, or a `Corpus` from `tinylm.data.load_corpus` to choose its glob, JSONL field and
    UTF-8 error policy), tokenized with the run's tokenizer. A bare n-gram file has no tokenizer of its
    own: give ``data_dir`` (its shards carry one) or ``tokenizer`` (a tokenizer JSON file). ``stride``:
    sliding windows, 1..the run's block_size (`evaluate_tokens`); None is disjoint windows.
    ``threads``: CPU threads; None follows `tinylm.device.use_threads` (busy cores left out, said to ``log``).
    ``quant`` ("int8"): evaluate a GPT with its matrices in int8 (`tinylm.model.quant`), as decoding with it reads them.
    """
    check_split_or_corpus(split, corpus)
    path = Path(run_dir)
    if path.is_file() and path.suffix != ".npz":
        raise TinyLMError(f"{path} is neither a run folder nor an n-gram model file (.npz); give the folder "
                          "`tinylm train` wrote")
    if path.suffix == ".npz":
        if quant is not None:
            raise TinyLMError(f"--quant int8 quantizes a GPT's matrices; {path} is an n-gram model: drop --quant")
        model, tok = _ngram_file(path, data_dir, tokenizer)
        block_size, recorded = model.config.block_size, None  # an n-gram scores without windows
        start_id = None
    else:
        if tokenizer is not None:
            raise TinyLMError("--tokenizer is for a bare n-gram .npz file; a run folder evaluates with its own "
                              "tokenizer")
        run = load_run(path, checkpoint=checkpoint, device=device)
        model, tok = run.model, run.tokenizer
        if quant is not None:
            from tinylm.model.quant import check_quantizable, quantize_int8

            check_quantizable(model, quant)
            quantize_int8(model)
        start_id = run.start_ids[-1] if run.start_ids else None
        block_size = run.config.model.block_size
        recorded = run.info.get("data", {}).get("dir")
    check_stride(stride, window_size(model, block_size), f" of {run_dir}")  # before the text is read
    if corpus is not None:
        text = corpus_text(corpus, tok)
    else:
        folder = data_dir or recorded
        if not folder:
            raise TinyLMError(f"{run_dir} does not say where its data is; give the shard folder with --data-dir "
                              "or a corpus with --corpus")
        if not Path(folder).is_dir():
            raise TinyLMError(f"the data of {run_dir} is not at {folder} any more; give its shard folder with "
                              "--data-dir, or evaluate on a corpus with --corpus")
        shards = ShardSet.open(folder)
        check_same_tokenizer(shards.meta["tokenizer"]["fingerprint"], tok,
                             f"the shards in {folder} were made with another tokenizer than {run_dir}'s",
                             "give the run's own data folder, or evaluate on a corpus with --corpus")
        text = split_text(shards, split)
    with use_threads(device, threads, log=log):  # once everything is checked: an error stays one line
        return evaluate_model(model, text, tok, block_size=block_size, batch_size=batch_size,
                              max_tokens=max_tokens, stride=stride, device=device, progress=progress,
                              start_id=start_id)


def _ngram_file(path: Path, data_dir: str | None, tokenizer: str | None):
    """An n-gram model file behind `NGramLM`, with the tokenizer it needs."""
    from tinylm.config import GPTConfig
    from tinylm.model import NGramLM, NGramModel
    from tinylm.run import TOKENIZER_FILE
    from tinylm.tokenizers.base import load_tokenizer

    ngram = NGramModel.load(path)
    beside = path.with_name(TOKENIZER_FILE)  # a run folder's ngram.npz has its tokenizer next to it
    if tokenizer is not None:
        tok = load_tokenizer(tokenizer)
    elif data_dir is not None:
        tok = ShardSet.open(data_dir).tokenizer()
    elif beside.is_file():
        tok = load_tokenizer(beside)
    else:
        raise TinyLMError(f"{path} is an n-gram model file without a tokenizer; give --data-dir (the shards it "
                          f"was counted on) or --tokenizer (none is beside it as {TOKENIZER_FILE})")
    if ngram.tokenizer_fingerprint is not None:  # a file counted before fingerprints were kept has none
        check_same_tokenizer(ngram.tokenizer_fingerprint, tok,
                             f"{path} was counted with another tokenizer than the one given",
                             "give the shards or tokenizer it was counted with")
    if tok.vocab_size != ngram.vocab_size or tok.eos_id != ngram.eos_id:
        raise TinyLMError(f"{path} was counted with another tokenizer ({ngram.vocab_size} tokens) than the one given "
                          f"({tok.vocab_size} tokens)")
    config = GPTConfig(family="ngram", vocab_size=ngram.vocab_size, block_size=1024, order=ngram.order)
    return NGramLM(ngram, config), tok
