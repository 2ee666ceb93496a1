"""The scheduler's rows and batches: what one decoding step runs together, and the rules a batch is rebuilt by.

A `Row` is one sample of one request; a `Batch` is the rows one `tinylm.generate.steps.Decoder` decodes
together, right-aligned (every row's last fed token in column ``length - 1``, shorter rows padded on the
left and hidden by the attention mask).

**Leaving.** Rows that finished, failed or were cancelled leave the batch at a rebuild. `leaving` looks
at each row once: `Scheduler.cancel` runs on the HTTP layer's thread and may mark a job at any moment,
so the new cache is sized and its rows copied from that one look. A continuous batch (a KV cache) is
merged anew without the leaving rows and the columns only they used; a static one keeps the others' rows
(`shrink`, the cache's ``reorder``), columns and all.

**Static batches.** An RNN's state or an n-gram's token history (models that make their own cache, see
`tinylm.generate.cache.cache_for`) has no columns to re-align, so the rows admitted together are prefilled
together and decoded until each finishes, and waiting rows start with the next batch. Each such batch is
kept small enough that its longest prompt plus its largest ``max_new_tokens`` fits the context, and that
its prefill's logits (rows x longest prompt x vocabulary) stay under `PREFILL_LOGITS` (`fits_static`), the
bound the continuous path keeps by prefilling in groups (`prefill_groups`; one row always starts, whatever
its size).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from tinylm.generate.steps import Decoder, FinishReason
from tinylm.generate.stream import TextStream
from tinylm.serve.jobs import Job, TokenLogprob

PREFILL_LOGITS = 1 << 26  # most logits one prefill may produce: 256 MB in float32


@dataclass
class Row:
    """One sample being generated: its tokens so far and its text stream."""

    job: Job
    index: int  # the choice index: prompt index x n + sample index
    seq: list[int]  # the prompt, then the new tokens
    prompt_len: int
    stream: TextStream
    finish_reason: FinishReason | None = None
    held: list[TokenLogprob] = field(default_factory=list)  # drawn tokens whose text is not released yet

    @property
    def n_new(self) -> int:
        return len(self.seq) - self.prompt_len

    @property
    def fed(self) -> int:
        """Tokens whose keys and values are in the cache: all but the newest (sampled, not yet fed)."""
        return len(self.seq) - 1

    @property
    def remaining(self) -> int:
        """Tokens still to draw; each needs one more decoding step."""
        return self.job.params.max_new_tokens - self.n_new

    @property
    def done(self) -> bool:
        return self.finish_reason is not None or self.job.cancelled or self.job.failed

    @property
    def generator(self) -> torch.Generator | None:
        return self.job.generators[self.index] if self.job.generators is not None else None


@dataclass
class Batch:
    """Rows decoded together by one `Decoder`: right-aligned (every row's last fed token in column ``length - 1``)."""

    rows: list[Row]
    decoder: Decoder


def leaving(rows: Sequence[Row]) -> tuple[list[bool], int]:
    """Which of ``rows`` leave the batch now (finished, failed or cancelled), from one look at each row, and
    how many of those were cancelled before they finished."""
    gone, cancelled_rows = [], 0
    for r in rows:
        cancelled = r.job.cancelled  # read once
        gone.append(r.finish_reason is not None or cancelled or r.job.failed)
        cancelled_rows += cancelled and r.finish_reason is None
    return gone, cancelled_rows


def shrink(batch: Batch, keep: list[int], device: torch.device) -> Batch | None:
    """A static batch with only the rows ``keep``: the cache keeps their rows (``reorder``), columns and all."""
    if not keep:
        return None
    if len(keep) < len(batch.rows):
        batch.decoder.reorder(torch.tensor(keep, device=device))
        batch.rows = [batch.rows[i] for i in keep]
    return batch


def prefill_groups(rows: list[Row], vocab_size: int) -> list[list[Row]]:
    """The new rows in groups whose prefill logits (B, P, V) stay under `PREFILL_LOGITS` numbers.

    The model computes logits at every prompt position (echo's logprobs use them); for a big
    vocabulary and long prompts, 32 rows at once would need gigabytes.
    """
    longest = max(len(r.seq) for r in rows)
    size = max(1, PREFILL_LOGITS // (longest * vocab_size))
    return [rows[i:i + size] for i in range(0, len(rows), size)]


def fits_static(rows: list[Row], prompt_len: int, max_new_tokens: int, block_size: int, vocab_size: int) -> bool:
    """Whether a row joins a static batch without outgrowing the context (its rows are left-padded to
    the longest prompt, and each grows by up to the largest max_new_tokens) or making the prefill's
    logits (rows, longest prompt, V) exceed `PREFILL_LOGITS` (the first row always starts)."""
    longest = max([prompt_len] + [r.prompt_len for r in rows])
    most = max([max_new_tokens] + [r.job.params.max_new_tokens for r in rows])
    logits = (len(rows) + 1) * longest * vocab_size
    return longest + most <= block_size and (not rows or logits <= PREFILL_LOGITS)


def mask_excluded(rows: Sequence[Row], logits: Tensor) -> None:
    """Set to -inf, in place, the logits (B, V) of the ids each row's request never draws (`PreparedRequest.excluded`:
    ids past the tokenizer's vocabulary, padding, BOS, reserved ids, <unk>), as the library's engine does."""
    masks = [row.job.request.excluded for row in rows]  # per row: stop ids may differ
    if all(m is masks[0] for m in masks):  # as a rule every row has the same: one operation for the batch
        if masks[0] is not None:
            logits.masked_fill_(masks[0], float("-inf"))
    else:
        for b, excluded in enumerate(masks):
            if excluded is not None:
                logits[b].masked_fill_(excluded, float("-inf"))
