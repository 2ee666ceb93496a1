"""The batching scheduler: many requests, one model, one decoding step for all of them at a time.

A decoding step costs about the same for 1 row as for 32 on a CPU or GPU (it is dominated by
reading the weights), so a server that answers requests one after another wastes most of the
machine. The scheduler runs every request's samples ("rows") through the model *together*, in
one background thread that owns the model:

1. **Admit.** Waiting rows join the batch between two steps, up to ``max_batch_size`` rows.
   When the batch is idle, the first request waits ``batch_window`` seconds for others to arrive,
   so that requests sent together are prefilled together. When rows are running, new ones join
   at the next step at once (continuous batching, as in Orca and vLLM): a short request never
   waits for a long one to finish. Admission is fair: requests are served in arrival order,
   taking one row from each waiting request in turn, so a request asking for ``n = 100`` samples
   cannot lock out the ones behind it.
2. **Prefill.** The new rows' prompts run through the model at once (left-padded, as in
   `tinylm.generate.engine`), filling a KV cache of their own; each row samples its first token.
3. **Merge.** The new rows' cache is joined to the running batch's. All rows are kept
   *right-aligned*: every row's last token sits in the same column, and shorter rows are padded
   on the left, hidden by the attention mask (each row's position ids count its own tokens, so
   padding changes nothing it computes). A merged cache holds exactly the columns needed: as
   many as the longest row has tokens, plus room for the steps until the next row must finish.
4. **Decode.** One step feeds every row's last token (B, 1), appends its keys and values, and
   gives each row's next-token logits; each row samples with its own settings.
5. **Leave.** Rows that finished (a stop token, a stop string, ``max_tokens``) or whose client
   went away leave the batch; the cache is rebuilt without them and without the columns that
   only they used, so the batch never outgrows the model's context.

**Per-row sampling settings.** Rows of different requests may use different temperatures,
top-k, top-p and min-p in the same step: the logits are grouped by settings and each group
is filtered and drawn with `tinylm.generate.sampling.sample` (filters work row by row, so grouping
changes nothing). Every row draws from its own `torch.Generator`, seeded like the library's
from the request's ``seed`` and the row's sample index (`prompt_generators(seed, prompts, n)`: sample
s of every prompt from (seed, s), so a prompt's text does not depend on the other prompts), made on
the model's device when the job is submitted (the draw happens where the probabilities are: a CPU
generator cannot draw from CUDA tensors). So a seeded request gives the same tokens whatever else is
in the batch, and the same as `tinylm.generate.generate` with that seed, up to float rounding between
matrix shapes (a near-tie of two tokens could in principle break the other way).

**Text and logprobs in step** (`tinylm.serve.release`): a row's text is released in whole characters,
never what may still turn into a stop string, and each event lists the tokens whose text begins in the
text released so far, so logprobs cover exactly the returned text.

**Context.** The scheduler never slides a window: `submit` refuses a prompt whose length plus
``max_new_tokens`` exceeds the model's ``block_size`` (the request's rules, `tinylm.generate.request`;
the API answers 400 before that), so every row fits the context from start to end.

**Prefix cache** (`tinylm.generate.prefix_cache`): a chat's next request sends the whole conversation again. When
a row finishes, the keys and values of its tokens (prompt and reply) are kept in a small LRU, bounded by
``prefix_cache_mb``, keyed by token ids (and adapter); a new row whose prompt begins with a kept sequence is
prefilled alone, the shared prefix copied in and the model run on the rest only. Rows that want their prompt's
logprobs (echo) read the whole prompt. ``stats()`` counts the prompt tokens run and reused.

**Other model families.** An RNN's state or an n-gram's token history has no columns to re-align, so
for those the scheduler batches statically (`tinylm.serve.batch`): the rows admitted together are
prefilled together and decoded until each finishes, and waiting rows start with the next batch.
Admission is fair in the same way.

**Adapters** (`tinylm.serve.adapters`): with LoRA adapters stacked on the model, each job names the
adapter its rows read (0: the base), and before each prefill and each step the scheduler tells the
adapters which row reads which (`ServedAdapters.choose`), so rows of any adapters share one batch.

**Speculative decoding** (`tinylm.serve.drafting`): with a ``draft``, a batch of one row decodes by
speculative rounds while drafting pays; batches of two rows or more decode step by step as above.

**Cancelling.** `cancel` marks a request; its rows leave the batch before the next step, which
frees their slots for waiting requests. The HTTP layer calls it when a client disconnects, from
its own thread, at any moment: so the scheduler looks at which rows are leaving (finished,
failed, cancelled) once per rebuild (`tinylm.serve.batch.leaving`), and sizes the new cache and copies
the rows from that one look; a cancel landing in the middle waits for the next step.

**Failures.** A failure in sampling (a request whose settings the sampling functions cannot
handle) fails the jobs of that sampling group alone, with `JobFailed` (status 400 when the
library refused the settings, 500 otherwise); the other rows of the step go on. A failure
anywhere else in a step (the model itself, an out-of-memory, a panic in a Rust tokenizer,
which is a BaseException: see `is_crash`) fails the jobs in the batch, and the scheduler
keeps serving the others waiting.

**Shutting down.** `end_all` (the server calls it when it stops) fails every running and waiting
job with status 503 before the next step, and refuses new ones; `close` stops the thread.

Events (`tinylm.serve.jobs`) go back to the caller through ``Job.on_event``, called from the scheduler's
thread with the events of one step (the HTTP layer hands them to its event loop).
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict, deque
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from tinylm.errors import TinyLMError
from tinylm.generate.fast import make_decoder
from tinylm.generate.prefix_cache import SERVE_BUDGET_MB, PrefixCache
from tinylm.generate.request import RequestRules
from tinylm.generate.sampling import prompt_generators, sample, token_logprobs
from tinylm.generate.speculative import Draft
from tinylm.generate.steps import Decoder, left_pad
from tinylm.generate.stream import TextStream
from tinylm.serve.batch import Batch, Row, fits_static, leaving, mask_excluded, prefill_groups, shrink
from tinylm.serve.drafting import Drafting
from tinylm.serve.jobs import ChoiceEvent, Job, JobDone, JobFailed, is_crash
from tinylm.serve.release import accept, drawn, prompt_logprobs, top_logprobs
from tinylm.tokenizers.base import Tokenizer


class Scheduler:
    """Runs jobs through ``model`` in batched decoding steps on a background thread (see the module docstring).

    ``tokenizer`` turns tokens into text and gives the end-of-text id that stops a row;
    ``max_batch_size`` is the most rows decoded together (1 serves one sample at a time);
    ``batch_window`` is how long an idle scheduler waits for more requests before prefilling;
    ``adapters`` (a `tinylm.serve.adapters.ServedAdapters`) are the LoRA adapters a job may name.
    ``prefix_cache_mb`` bounds the prefix cache (module docstring; 0 turns it off).

        scheduler = Scheduler(run.model, run.tokenizer).start()
        scheduler.submit(Job([ids], SamplingParams(max_new_tokens=20), on_event=print))
    """

    def __init__(self, model: nn.Module, tokenizer: Tokenizer, *, max_batch_size: int = 32,
                 batch_window: float = 0.002, draft: Draft | None = None, draft_k: int = 4,
                 adapters: Any = None, prefix_cache_mb: float = SERVE_BUDGET_MB) -> None:
        if not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise TinyLMError(f"max_batch_size must be an integer >= 1, got {max_batch_size!r}")
        if batch_window < 0:
            raise TinyLMError(f"batch_window must be 0 or more seconds, got {batch_window}")
        self.model = model.eval()
        self.tokenizer = tokenizer
        # prompts, stop ids (a job without its own: EOS and end-of-turn tokens), the ids no row may draw
        self.rules = RequestRules(model, tokenizer, prompt_vocab="tokenizer")
        self.block_size: int = model.config.block_size
        self.max_batch_size = max_batch_size
        self.batch_window = batch_window
        self.device = next(model.parameters()).device
        self.vocab_size = tokenizer.vocab_size
        # a KV cache can be re-aligned column by column, so rows may join a running batch; other caches cannot
        self.continuous = getattr(model, "new_cache", None) is None
        if draft is not None and not self.continuous:
            raise TinyLMError("speculative decoding rolls a Transformer's KV cache back; this model keeps another "
                              "kind of state: serve it without --draft")
        if not isinstance(draft_k, int) or draft_k < 1:
            raise TinyLMError(f"the draft length must be an integer >= 1, got {draft_k!r}")
        self.drafting = Drafting(draft, draft_k) if draft is not None else None
        self.adapters = adapters
        # keys and values can be copied row by row only where the batch is continuous (a KV cache)
        self.prefix_cache = PrefixCache.megabytes(prefix_cache_mb) if self.continuous else None
        self._cond = threading.Condition()
        self._waiting: deque[Job] = deque()  # jobs with rows not yet admitted, in arrival order
        self._batch: Batch | None = None
        self._admitted: list[Row] = []
        self._thread: threading.Thread | None = None
        self._closing = False
        self._ending: str | None = None  # set by `end_all`: the message the jobs fail with
        # counters for /health and the tests
        self.steps = 0
        self.jobs = 0
        self.largest_batch = 0
        self.cancelled_rows = 0
        self.prompt_tokens_run = 0  # prompt tokens prefilled through the model
        self.prompt_tokens_reused = 0  # prompt tokens whose keys and values came from the prefix cache

    # -- the public side (any thread) -------------------------------------------------------------

    def start(self) -> Scheduler:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="tinylm-scheduler", daemon=True)
            self._thread.start()
        return self

    def close(self) -> None:
        """Stop the thread after the current step; unfinished jobs get no more events."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def submit(self, job: Job) -> None:
        """Queue a job; its rows join the batch as slots free up. Refuses prompts that would outgrow the context."""
        job.request = self.rules.prepare(job.prompts, job.params, long_prompts="refuse")  # batches never slide
        if job.adapter and not 0 < job.adapter <= (len(self.adapters) if self.adapters is not None else 0):
            raise TinyLMError(f"no adapter of index {job.adapter} is served")
        if job.generators is None and not job.params.greedy:  # where the probabilities will be
            job.generators = prompt_generators(job.params.seed, len(job.prompts), job.n, self.device,
                                               prompts=job.prompts)
        with self._cond:
            if self.closing:
                raise TinyLMError("the server is shutting down")
            self.jobs += 1
            self._waiting.append(job)
            self._cond.notify_all()

    @property
    def closing(self) -> bool:
        """Whether the scheduler takes no more jobs (`end_all` or `close` was called)."""
        return self._closing or self._ending is not None

    def end_all(self, message: str = "the server is shutting down") -> None:
        """Fail every running and waiting job with ``message`` (status 503) before the next step; refuse new ones.

        The server calls it when it shuts down, so that clients get an answer rather than a cut connection.
        """
        with self._cond:
            self._ending = message
            self._cond.notify_all()

    def cancel(self, job: Job) -> None:
        """Drop a job: its waiting rows are forgotten, its running rows leave before the next step."""
        with self._cond:
            if job.rows_left == 0 or job.cancelled:
                return
            job.cancelled = True
            if job in self._waiting:
                self._waiting.remove(job)
            self._cond.notify_all()

    def stats(self) -> dict[str, int]:
        batch, drafting = self._batch, self.drafting
        with self._cond:
            waiting = sum(len(job.pending) for job in self._waiting)
        return {"active_rows": len(batch.rows) if batch else 0, "waiting_rows": waiting,
                "max_batch_size": self.max_batch_size, "largest_batch": self.largest_batch, "steps": self.steps,
                "jobs": self.jobs, "cancelled_rows": self.cancelled_rows,
                "drafted": drafting.drafted if drafting else 0, "kept": drafting.kept if drafting else 0,
                "prompt_tokens_run": self.prompt_tokens_run, "prompt_tokens_reused": self.prompt_tokens_reused,
                "prefix_cache_entries": len(self.prefix_cache) if self.prefix_cache else 0,
                "prefix_cache_bytes": self.prefix_cache.nbytes if self.prefix_cache else 0}

    # -- the loop (scheduler thread) ---------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            try:
                if not self._iteration():
                    return
            except BaseException as e:  # a bug, an out-of-memory, a tokenizer's panic: fail the running jobs, go on
                if not is_crash(e):
                    raise
                self._fail_running(f"{type(e).__name__}: {e}")

    @torch.inference_mode()
    def _iteration(self) -> bool:
        """Admit, prefill, merge, decode one step, retire. False when closing."""
        new_rows = self._admit()
        if new_rows is None:
            return False
        outbox: dict[Job, list] = defaultdict(list)
        self._admitted = new_rows  # for _fail_running, until they are in the batch
        if self._ending is not None:  # shutting down: every job gets its 503 now
            self._fail_running(self._ending, status=503)
            return True
        self._drop_cancelled()
        if new_rows and self.continuous:
            # the prefilled rows' caches have no room to grow: merging gives the batch its columns
            groups = self._prefill_plan(new_rows)
            fresh = [self._prefill(group, outbox) for group in groups]
            self._batch = self._merge(fresh if self._batch is None else [self._batch, *fresh])
        elif new_rows:
            self._batch = self._retire(self._prefill(new_rows, outbox))  # a static batch: nothing runs yet
        if new_rows:
            self.largest_batch = max(self.largest_batch, len(self._batch.rows) if self._batch else 0)
        self._admitted = []
        if self._batch is not None:
            self._decode(self._batch, outbox)
            if any(r.done for r in self._batch.rows):
                self._batch = self._retire(self._batch)
        self._deliver(outbox)
        return True

    def _admit(self) -> list[Row] | None:
        """Rows to start now, taken one per waiting job in turn; waits while there is nothing to do."""
        with self._cond:
            idle = self._batch is None
            if idle:
                self._cond.wait_for(lambda: self._waiting or self._closing)
            if self._closing:
                return None
        if idle and self.batch_window > 0:
            time.sleep(self.batch_window)  # let requests sent together arrive together
        rows: list[Row] = []
        if self._batch is None:
            free = self.max_batch_size
        else:  # a static batch takes no one until it is done
            free = self.max_batch_size - len(self._batch.rows) if self.continuous else 0
        with self._cond:
            while free > 0 and self._waiting:
                job = self._waiting[0]
                r = job.pending[0]
                prompt = job.prompts[r // job.n]
                if not self.continuous and not fits_static(rows, len(prompt), job.params.max_new_tokens,
                                                           self.block_size, self.model.config.vocab_size):
                    break  # it starts the next static batch
                self._waiting.popleft()
                job.pending.popleft()
                stream = TextStream(self.tokenizer, job.params.stop)
                rows.append(Row(job, r, list(prompt), len(prompt), stream))
                free -= 1
                if job.pending:
                    self._waiting.append(job)  # round robin: its next row after the others' next
        return rows

    def _drop_cancelled(self) -> None:
        batch = self._batch
        if batch is not None and any(r.job.cancelled for r in batch.rows):
            self._batch = self._retire(batch)

    def _retire(self, batch: Batch) -> Batch | None:
        """The batch without its finished and cancelled rows."""
        return self._merge([batch]) if self.continuous else shrink(batch, self._staying(batch.rows), self.device)

    def _staying(self, rows: Sequence[Row]) -> list[int]:
        """The rows that stay in the batch, from one look at each (`tinylm.serve.batch.leaving`); counts the
        cancelled rows leaving."""
        gone, cancelled = leaving(rows)
        self.cancelled_rows += cancelled
        return [i for i, g in enumerate(gone) if not g]

    def _prefill_plan(self, rows: list[Row]) -> list[list[Row]]:
        """The new rows in prefill groups: each row with a cached prefix alone (it reads only the rest), the
        others together (`prefill_groups`)."""
        if self.prefix_cache is None:
            return prefill_groups(rows, self.model.config.vocab_size)
        alone = [r for r in rows if not r.job.prompt_logprobs
                 and self.prefix_cache.lookup(r.seq, namespace=r.job.adapter)[0] is not None]
        rest = [r for r in rows if r not in alone]
        return [[r] for r in alone] + (prefill_groups(rest, self.model.config.vocab_size) if rest else [])

    def _read_prompts(self, decoder: Decoder, rows: list[Row], idx: Tensor, mask: Tensor, every: bool) -> Tensor:
        """``decoder.start`` on the new rows' prompts, or for a lone row without echo, the prefix cache's `resume`
        (the longest cached prefix copied in, the rest run); counts the tokens run and reused."""
        if self.prefix_cache is not None and len(rows) == 1 and not every:
            logits, reused = self.prefix_cache.resume(decoder, rows[0].seq, namespace=rows[0].job.adapter)
        else:
            logits, reused = decoder.start(idx, mask, every=every), 0
        self.prompt_tokens_run += int(mask.sum()) - reused
        self.prompt_tokens_reused += reused
        return logits

    def _remember(self, batch: Batch) -> None:
        """Keep each finished row's tokens (prompt and reply, the last ``fed`` columns of its row) in the prefix
        cache: one sample per prompt, so that a request of many samples does not fill it alone.

        Not a lone row that decoded by speculative rounds: the round that finished it may have fed drafts past
        its last token. Nor a row that drew nothing (max_tokens 0), whose cache holds its whole prompt."""
        if self.prefix_cache is None or (self.drafting is not None and len(batch.rows) == 1):
            return
        for b, row in enumerate(batch.rows):
            if (row.finish_reason is not None and not row.job.failed and row.n_new > 0
                    and row.index % row.job.n == 0):
                self.prefix_cache.remember(batch.decoder, b, row.seq[:row.fed], namespace=row.job.adapter)

    def _prefill(self, rows: list[Row], outbox: dict[Job, list]) -> Batch:
        """Run the new rows' prompts through the model into a cache of their own; draw each row's first token.

        The cache holds the prompts alone when the batch is continuous (`_merge` then makes room),
        and the prompts plus every step to come when it is static.
        """
        idx, mask = left_pad([r.seq for r in rows], self.device)  # (Bn, P), (Bn, P)
        Bn, P = idx.shape
        capacity = P if self.continuous else P + max(r.remaining for r in rows)
        decoder = make_decoder(self.model, Bn, capacity)  # a GPT's: the decoding layout
        self._choose_adapters(decoder, rows)
        # every position's logits (Bn, P, V) only when a request wants its prompt's logprobs; each row counts its
        # own tokens
        echo = [b for b, r in enumerate(rows) if r.job.prompt_logprobs and r.index % r.job.n == 0]  # once per prompt
        logits = self._read_prompts(decoder, rows, idx, mask, every=bool(echo))
        for b in echo:
            outbox[rows[b].job].append(prompt_logprobs(rows[b], logits[b, P - rows[b].prompt_len:], self.tokenizer))
        last = logits[:, -1] if echo else logits  # (Bn, V)
        drawing = [b for b, r in enumerate(rows) if r.remaining > 0]
        for row in rows:
            if row.remaining == 0:  # max_tokens = 0: nothing to draw (echo alone)
                row.finish_reason = "length"
                outbox[row.job].append(ChoiceEvent(row.index, row.stream.finish(), finish_reason="length"))
        if drawing:
            self._draw([rows[b] for b in drawing], last[drawing], outbox)  # (b, V)
        return Batch(rows, decoder)

    def _decode(self, batch: Batch, outbox: dict[Job, list]) -> None:
        """One step for every row: feed its newest token, draw the next (a speculative round for a lone row)."""
        rows = batch.rows
        lone = self.drafting is not None and len(rows) == 1
        started = time.perf_counter()
        self._choose_adapters(batch.decoder, rows)
        if lone and self.drafting.round(rows[0], batch.decoder, self.vocab_size, outbox):
            self.steps += 1
            return
        tokens = torch.tensor([r.seq[-1] for r in rows], device=self.device)  # (B,)
        logits = batch.decoder.step(tokens)  # (B, V): each row's token at its own position (r.fed)
        self.steps += 1
        self._draw(rows, logits, outbox)
        if lone:
            self.drafting.plain_step(time.perf_counter() - started)

    def _choose_adapters(self, decoder: Decoder, rows: Sequence[Row]) -> None:
        """Before ``decoder`` runs ``rows``: which adapter each row reads (nothing to do without adapters)."""
        if self.adapters is not None:
            self.adapters.choose(decoder, [row.job.adapter for row in rows])

    def _draw(self, rows: list[Row], logits: Tensor, outbox: dict[Job, list]) -> None:
        """Sample each row's next token from logits (B, V) with its own settings; record it; emit events."""
        logits = logits.float()
        tokens = torch.zeros(len(rows), dtype=torch.long, device=logits.device)  # (B,)
        groups: dict[tuple, list[int]] = defaultdict(list)
        mask_excluded(rows, logits)
        for b, row in enumerate(rows):
            groups[row.job.sampling_key].append(b)
        for members in groups.values():
            params = rows[members[0]].job.params
            generators = None if params.greedy else [rows[b].generator for b in members]
            try:
                tokens[members] = sample(logits[members], params, generators)
            except Exception as e:  # these settings broke sampling: fail this group's jobs alone, the others go on
                status = 400 if isinstance(e, TinyLMError) else 500
                for job in {rows[b].job for b in members}:
                    self._fail_job(job, f"sampling with this request's settings failed: {type(e).__name__}: {e}",
                                   status, outbox)
        # (B,) log p of each token under the distribution it was drawn from: the model's, over the ids a sample may
        # take (as `tinylm sample` reports them and the playground charts them)
        logprobs = token_logprobs(logits, tokens).tolist()
        tops = top_logprobs(rows, logits, self.vocab_size)
        for b, (row, token) in enumerate(zip(rows, tokens.tolist())):
            if row.job.failed:  # failed in this step (a failed job's rows never outlive the step)
                continue
            outbox[row.job].append(accept(row, drawn(row, token, logprobs[b], tops.get(b, ()))))

    def _fail_job(self, job: Job, message: str, status: int, outbox: dict[Job, list]) -> None:
        """Fail one job in the middle of a step: its rows leave at the end of the step, its waiting rows never
        start, and its failure replaces whatever events it had in this step (`_deliver`)."""
        with self._cond:
            job.failed = True
            job.failure = JobFailed(message, status)
            if job in self._waiting:
                self._waiting.remove(job)
        outbox.setdefault(job, [])  # so that `_deliver` sees the job

    def _merge(self, batches: Sequence[Batch]) -> Batch | None:
        """One batch of the unfinished rows of ``batches``: a new cache, right-aligned, trimmed to what they need.

        Columns: as many as the longest row has tokens in the cache (L), plus room for the steps
        until some row must end (the fewest tokens any row has left). No row's tokens are lost:
        each row's tokens are the last ``row.fed`` columns of its batch, and ``row.fed <= L``.
        Since every row fits the context (prompt + max_new_tokens <= block_size), so does L plus
        the room: the longest row alone needs that much.
        """
        for batch in batches:
            self._remember(batch)
        # one look at which rows leave (`_staying`): a cancel arriving from now on waits for the next step
        keeps = [self._staying(b.rows) for b in batches]
        rows = [b.rows[i] for b, keep in zip(batches, keeps) for i in keep]
        if not rows:
            return None
        L = max(r.fed for r in rows)
        capacity = L + min(r.remaining for r in rows)
        parts = [(b.decoder, torch.tensor(keep, device=self.device)) for b, keep in zip(batches, keeps) if keep]
        return Batch(rows, type(parts[0][0]).merged(parts, L, capacity))

    def _deliver(self, outbox: dict[Job, list]) -> None:
        for job, events in outbox.items():
            if job.failed:  # failed in this step: its failure alone, once
                failure, job.failure = job.failure, None
                if failure is not None and not job.cancelled:
                    self._send(job, [failure])
                continue
            for event in events:
                if isinstance(event, ChoiceEvent) and event.finish_reason is not None:
                    job.rows_left -= 1
            if job.rows_left == 0:
                events.append(JobDone())
            if not job.cancelled:
                self._send(job, events)

    def _send(self, job: Job, events: list) -> None:
        try:
            job.on_event(events)
        except Exception:  # the receiver is gone (its event loop closed): nobody is listening any more
            job.cancelled = True

    def _fail_running(self, message: str, status: int = 500) -> None:
        """Fail every job with a row in the batch or being admitted; drop their rows, waiting ones too.

        With status 503 (shutting down, `end_all`), every waiting job fails as well.
        """
        batch, self._batch = self._batch, None
        rows = (batch.rows if batch is not None else []) + self._admitted
        self._admitted = []
        jobs = list(dict.fromkeys(r.job for r in rows))  # in order, once each
        with self._cond:
            if status == 503:
                jobs += [job for job in self._waiting if job not in jobs]
                self._waiting.clear()
            for job in jobs:
                job.failed = True
                job.failure = None  # sent here; the step's outbox is dropped
                if job in self._waiting:
                    self._waiting.remove(job)
        for job in jobs:
            if not job.cancelled:
                self._send(job, [JobFailed(message, status)])
