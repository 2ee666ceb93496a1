"""The server's speculative rounds: a batch of one row decodes by drafts when the server has a draft.

With a ``draft`` (`tinylm serve --draft`), a batch that holds one row (one client at a time, the case
where a step leaves most of the machine idle) decodes by speculative rounds
(`tinylm.generate.speculative`): the draft proposes tokens, one pass of the model over the row's KV
cache checks them (`tinylm.generate.rounds.check_drafts`), the acceptance rule keeps the model's
distribution, and the cache is cut back after a rejection. A `Pacer` times plain steps and rounds and
stops drafting while it does not pay. Batches of two rows or more decode step by step. A greedy request
gets the same tokens either way; a seeded sampled one follows the same distribution but not the same
text as without a draft.
"""

from __future__ import annotations

import time

from tinylm.generate.rounds import check_drafts
from tinylm.generate.speculative import Draft, Pacer
from tinylm.generate.steps import Decoder
from tinylm.serve.batch import Row
from tinylm.serve.jobs import Job
from tinylm.serve.release import accept, drawn, top_logprobs


class Drafting:
    """The server's draft, its `Pacer`, and the draft tokens proposed and kept (for /health and the tests)."""

    def __init__(self, draft: Draft, k: int) -> None:
        self.draft = draft
        self.pacer = Pacer(k)
        self.drafted = self.kept = 0

    def round(self, row: Row, decoder: Decoder, vocab_size: int, outbox: dict[Job, list]) -> bool:
        """A speculative round for a batch of one row; False (nothing done) when no draft is proposed."""
        params = row.job.params
        room = min(decoder.max_len - decoder.length - 1, row.remaining - 1)  # columns after the pending token
        n = min(self.pacer.drafts(), room)
        if n <= 0:
            return False
        started = time.perf_counter()
        excluded = row.job.request.draft_mask()
        drafts, q = self.draft.propose(row.seq, n, excluded, params, row.generator)
        drafts = drafts[:n]
        if not drafts:
            return False
        try:
            new, kept, logprobs = check_drafts(decoder, row.seq, drafts, q, excluded, params, row.generator)
        except Exception:  # settings sampling cannot take: the round was undone; the plain step fails the job
            return False
        self.drafted += len(drafts)
        self.kept += kept
        tops = top_logprobs([row] * len(new), logprobs, vocab_size)  # (log_softmax of log-probabilities is the same)
        for i, token in enumerate(new):
            outbox[row.job].append(accept(row, drawn(row, token, float(logprobs[i, token]), tops.get(i, ()))))
            if row.finish_reason is not None:
                break
        self.pacer.record(len(drafts), kept, time.perf_counter() - started)
        return True

    def plain_step(self, seconds: float) -> None:
        """A lone row's plain step took ``seconds`` (the pace drafting must beat)."""
        self.pacer.record(0, 0, seconds)
