"""Training batches: which token windows each optimizer step sees, as a pure function of the step.

Two ways to cut the token stream of the train split into rows of ``block_size`` inputs and targets
(targets are the inputs shifted one token left, so row t predicts token t + 1):

- **packed** (the default): windows of ``block_size + 1`` tokens at random offsets of the
  stream, exactly `ShardSet.sample_windows`. A window may cross a document boundary: the EOS
  between two documents is a token to predict like any other, and the next document is read
  after it. So in packed mode the EOS that ends the previous document plays the role of the
  lecture notes' fixed x_0 for the next one (as GPT-2's ``<|endoftext|>`` does); no BOS is
  inserted, because a window cut at a random offset has no document start to put it at.
  Every position is a real token: no padding, no mask, no wasted compute.
- **documents**: one document per row, as the notes describe batching: ``BOS, the document's
  tokens, EOS``, truncated to its first ``block_size + 1`` tokens when longer, and filled up
  with PAD when shorter. Padded positions are masked out of attention (``attention_mask`` False)
  and out of the loss (target `IGNORE_INDEX`). Documents are drawn uniformly at random; their
  boundaries are the EOS ids of the shard, which are exactly the document ends.

- **chats** (`tinylm finetune`): conversations, as `tinylm.data.chat_shards` stored them, packed
  several to a row (`pack_chats`) of ``block_size`` positions, or of a power-of-two fraction of it
  no shorter than 128 positions nor than the longest conversation, with as many more rows as keep a
  step's positions (`chat_width`: short chats in a long context need no long rows, whose attention
  costs more a token). Each conversation has its own segment id: a
  token attends only to its own conversation and its position counts from its conversation's
  start, so it is trained exactly as if it were alone in the row, while the step computes on as
  many real tokens as a pretraining step. A target counts in the loss only where the
  conversation's token is trained (what the assistant writes); every other target, and the
  padding at a row's end, is `IGNORE_INDEX`. The rows go through the conversations in epochs: each
  epoch a permutation of them drawn with ``(seed, epoch)`` and packed in that order, the steps
  taking the packed rows in turn.

Reproducibility without saved data state: the ``batch_size * grad_accum`` rows of step ``s`` are
drawn at once with a numpy Generator seeded with ``(seed, s)``, so the data a step sees depends
on nothing but the seed and the step number: resuming at step s needs no reader position. The
step's rows are then cut up, the same way in every process::

    micro-batch i          rows [i B, (i+1) B)                      (B = batch_size)
    its share in process r rows [i B + r B/W, i B + (r+1) B/W)      (W processes)

so 2 micro-batches of B/2 rows see exactly the rows of 1 micro-batch of B, and W processes of
B/W rows each see exactly the rows of one process of B: the equivalences the tests check. A step
of the sequence-length schedule (`tinylm.train.schedule.window_at`) draws rows of ``window`` tokens,
``k = block_size / window`` times as many, and is cut the same way with ``B = k * batch_size``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from tinylm.data.chat_shards import chat_arrays, pack_chats, packed_rows
from tinylm.data.shards import ShardSet
from tinylm.errors import TinyLMError
from tinylm.model.gpt import IGNORE_INDEX

BATCH_MODES = ("packed", "documents", "chats")


@dataclass
class MicroBatch:
    """Rows of inputs and targets, (B, T) each; for document rows the padding mask (True = real token), for
    packed conversations their segment ids (and how many of the positions are padding)."""

    x: np.ndarray
    y: np.ndarray
    attention_mask: np.ndarray | None = None
    segments: np.ndarray | None = None
    padding: int = 0

    @property
    def n_targets(self) -> int:
        """How many positions count in the loss (all of them, unless some targets are padding)."""
        return int((self.y != IGNORE_INDEX).sum())

    @property
    def n_inputs(self) -> int:
        """The tokens the rows hold, padding left out."""
        if self.attention_mask is not None:
            return int(self.attention_mask.sum())
        return self.x.size - self.padding

    def rows(self, start: int, stop: int) -> MicroBatch:
        mask = None if self.attention_mask is None else self.attention_mask[start:stop]
        segments = None if self.segments is None else self.segments[start:stop]
        return MicroBatch(self.x[start:stop], self.y[start:stop], mask, segments)

    def to(self, device: torch.device) -> dict[str, Tensor]:
        """The model's inputs as tensors on ``device``: ``idx``, ``targets``, and ``attention_mask`` or
        ``segment_ids`` where the rows have them."""
        tensors = {"idx": self.x, "targets": self.y, "attention_mask": self.attention_mask, "segment_ids": self.segments}
        return {name: torch.from_numpy(a).to(device, non_blocking=True) for name, a in tensors.items() if a is not None}


class BatchSource:
    """Draws the micro-batches of each training step from the train split (see the module docstring)."""

    def __init__(
        self,
        shards: ShardSet,
        *,
        mode: str,
        batch_size: int,
        block_size: int,
        seed: int,
        bos_id: int,
        pad_id: int,
        split: str = "train",
        pack: bool = True,
    ) -> None:
        if mode not in BATCH_MODES:
            raise TinyLMError(f"unknown batch mode {mode!r}; expected one of {', '.join(BATCH_MODES)}")
        self.shards, self.mode, self.split, self.pack = shards, mode, split, pack
        self.batch_size, self.block_size, self.seed = batch_size, block_size, seed
        self.bos_id, self.eos_id, self.pad_id = bos_id, shards.eos_id, pad_id
        if mode == "chats":
            self.chat_tokens, self.chat_trained, self.chat_offsets = chat_arrays(shards, split)
            self._epoch_rows: dict[int, list[np.ndarray]] = {}  # the newest epoch's packed rows
            self._epoch_sizes: list[int] = []  # how many rows each epoch packed into, epoch 0 on
            self.chat_width = chat_width(self.chat_offsets, block_size) if pack else block_size
            if len(self.chat_offsets) < 2 or not len(self.packed_epoch(0)):
                raise TinyLMError(f"the {split} split has no conversations to train on")
            return
        data = shards.tokens(split)
        if mode == "packed":
            if len(data) < block_size + 1:
                raise TinyLMError(
                    f"the {split} split has {len(data)} tokens, fewer than block_size + 1 = {block_size + 1}; "
                    "use a smaller block_size or more text"
                )
        else:
            ends = np.flatnonzero(data == self.eos_id)  # one EOS ends every document
            if len(ends) == 0:
                raise TinyLMError(f"the {split} split has no documents; give a corpus with more text")
            self.doc_starts = np.concatenate(([0], ends[:-1] + 1))  # (n_docs,)
            self.doc_ends = ends  # the EOS position of each document

    def step_batch(self, step: int, grad_accum: int = 1, window: int | None = None) -> MicroBatch:
        """All ``batch_size * grad_accum`` rows of optimizer step ``step`` (every micro-batch, every process).

        ``window`` (packed batches; `tinylm.train.schedule.window_at`): rows of that many tokens instead of
        block_size, ``block_size / window`` times as many of them, so that the step holds the same tokens."""
        rng = np.random.default_rng([self.seed, step])
        n_rows = self.batch_size * grad_accum
        if self.mode == "packed":
            T = window or self.block_size
            if self.block_size % T:
                raise TinyLMError(f"a window of {T} tokens does not divide block_size {self.block_size}")
            x, y = self.shards.sample_windows(self.split, n_rows * (self.block_size // T), T, rng)
            return MicroBatch(x, y)
        if self.mode == "chats":
            n_rows *= self.block_size // self.chat_width
            return self._chats(self.chat_rows(step * n_rows, n_rows))
        return self._documents(rng.integers(0, len(self.doc_starts), size=n_rows))

    def packed_epoch(self, epoch: int) -> list[np.ndarray]:
        """Epoch ``epoch``'s rows: its permutation of the conversations, drawn with (seed, epoch), packed in order."""
        if epoch not in self._epoch_rows:
            count = len(self.chat_offsets) - 1
            order = np.random.default_rng([self.seed, epoch]).permutation(count)
            if self.pack:
                rows = pack_chats(self.chat_offsets, order, self.chat_width)
            else:  # one conversation a row (a recurrent model, which reads a row as one sequence)
                rows = [np.array([c]) for c in order[np.diff(self.chat_offsets)[order] > 1]]
            self._epoch_rows = {epoch: rows}  # the newest only
        return self._epoch_rows[epoch]

    def chat_rows(self, first: int, n: int) -> list[np.ndarray]:
        """Rows ``first`` to ``first + n`` of the endless sequence of epochs."""
        rows = []
        epoch, start = 0, 0  # the epoch holding row ``first + len(rows)``, and its first row's index
        while len(rows) < n:
            while len(self._epoch_sizes) <= epoch:
                self._epoch_sizes.append(len(self.packed_epoch(len(self._epoch_sizes))))
            at = first + len(rows) - start
            if at < self._epoch_sizes[epoch]:
                rows.extend(self.packed_epoch(epoch)[at:at + n - len(rows)])
            else:
                epoch, start = epoch + 1, start + self._epoch_sizes[epoch]
        return rows

    def _chats(self, rows: list[np.ndarray]) -> MicroBatch:
        """Packed conversations: inputs, targets (`IGNORE_INDEX` where a token is not trained), segment ids."""
        x, y, segments = packed_rows(self.chat_tokens, self.chat_trained, self.chat_offsets, rows, self.chat_width,
                                     self.pad_id, IGNORE_INDEX)
        padding = int((segments == np.array([len(row) for row in rows])[:, None]).sum())
        # one conversation a row needs no segments: right padding is never attended to, nor read by a recurrence
        return MicroBatch(x, y, segments=segments if self.pack else None, padding=padding)

    def _documents(self, docs: np.ndarray) -> MicroBatch:
        T = self.block_size
        data = self.shards.tokens(self.split)
        rows = np.full((len(docs), T + 1), self.pad_id, dtype=np.int64)  # (B, T+1), PAD everywhere first
        lengths = np.empty(len(docs), dtype=np.int64)
        for r, d in enumerate(docs):
            # BOS, the document, its EOS; the first T + 1 tokens of that when it is longer
            n = min(int(self.doc_ends[d] - self.doc_starts[d]) + 1, T)  # document tokens with EOS, at most T
            rows[r, 0] = self.bos_id
            rows[r, 1 : n + 1] = data[self.doc_starts[d] : self.doc_starts[d] + n]
            lengths[r] = n + 1
        x, y = rows[:, :-1].copy(), rows[:, 1:].copy()  # (B, T) each
        position = np.arange(T)[None, :]  # (1, T)
        y[position + 1 >= lengths[:, None]] = IGNORE_INDEX  # a target that is padding
        mask = position < lengths[:, None]  # (B, T): real input tokens
        return MicroBatch(x, y, mask)


def chat_width(offsets: np.ndarray, block_size: int, shortest: int = 128) -> int:
    """The length of packed conversation rows: ``block_size`` halved while the half still divides it and holds
    the longest conversation (every token but its last, at most ``block_size``) and ``shortest`` positions."""
    longest = int(min(np.diff(offsets).max() - 1, block_size)) if len(offsets) > 1 else block_size
    width = block_size
    while width % 2 == 0 and width // 2 >= max(longest, shortest):
        width //= 2
    return width


def micro_batches(batch: MicroBatch, batch_size: int, rank: int = 0, world_size: int = 1) -> list[MicroBatch]:
    """Process ``rank``'s share of each micro-batch of a step's rows (see the module docstring)."""
    if batch_size % world_size:
        raise TinyLMError(f"batch_size {batch_size} must divide evenly among {world_size} processes; "
                          f"use a multiple of {world_size}")
    share = batch_size // world_size
    starts = [i * batch_size + rank * share for i in range(len(batch.x) // batch_size)]
    return [batch.rows(lo, lo + share) for lo in starts]
