"""The generation engine: prefill, then one cached step per new token, for a batch of prompts.

Generating is a loop of three small functions (the shape of gpt-fast's generate.py):

- prefill (``decoder.start``): run the model once over the prompts; the KV cache stores every
  layer's keys and values; the logits of the last position give the first new token.
- `sample` (`tinylm.generate.sampling`): logits -> token, greedy or a draw after the filters.
- one step (``decoder.step``): run the model on the new tokens only (B, 1); each layer appends
  their keys and values to the cache and attends over everything stored.

The decoder is `tinylm.generate.fast.StaticDecoder` for a GPT (its weights laid out for
one-token steps, a static cache, optionally a compiled step) and
`tinylm.generate.steps.CachedDecoder` (the model's own forward and cache) for other families.

**Batches of different lengths.** Prompts are padded on the *left*, so that every row's last
token sits in the same column and the next tokens are appended in the same column for all rows:

    row 0:  pad pad  The  cat         attention_mask  0 0 1 1
    row 1:  Once upon a   time                        1 1 1 1

The attention mask hides the padding from every query, and position ids count real tokens
only (row 0's "The" is at position 0, not 2), so each row computes exactly what it would
compute alone (up to float rounding from different matrix shapes; the tests pin it).

**The context window.** A model has seen positions 0..block_size-1 in training and no further
(a learned position table has no row beyond). A prompt longer than the window keeps its last
block_size tokens, with a warning (`tinylm.generate.steps.fit_prompt`: `generate` and `stream` apply
it through the request's rules, `tinylm.generate.request`, so the first new token is the one
`tinylm next-token` ranks first). When prompt plus generation outgrow the window,
tinylm keeps the most recent ``keep`` tokens (``SamplingParams.window_keep``, default half the
window), recomputes their keys and values from scratch with positions restarting at 0, and goes
on; when the window fills again, it cuts again. Recomputing is necessary for every position
encoding: with learned or sinusoidal positions the stored keys carry absolute positions, and
with any encoding (RoPE included) the keys of layer 2 and up were computed while attending to the
tokens that are now dropped. A warning says when this happens. Dropping ``block_size - keep``
tokens at once, rather than one per step, lets the cache serve the next steps instead of paying
a full recompute for every token (``window_keep = block_size`` is the one-token slide, a full
recompute per step). `context_start` is the rule, as a function of the sequence length alone, so
the engine and the reference generator agree on what the model sees at every step.

**Stopping.** A sample ends at a stop id (the tokenizer's EOS by default; the id is kept in
``token_ids`` and left out of the text), at a stop string (the text is cut before it; the tokens
up to the one that completed it are kept in ``token_ids``), or after ``max_new_tokens``
(finish reason "length"). Rows that finish early ride along until the whole batch is done.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from tinylm.errors import TinyLMError
from tinylm.generate.beam import beam_search_completions
import tinylm.generate.fast as fast
from tinylm.generate.fast import StaticDecoder, make_decoder
from tinylm.generate.prefix_cache import PrefixCache
from tinylm.generate.request import LongPrompts, RequestRules
from tinylm.generate.sampling import SamplingParams, prompt_generators, sample, token_logprobs
from tinylm.generate.steps import (
    CachedDecoder,
    Completion,
    FinishReason,
    accept_token,
    context_start,
    keep_prompt,
    left_pad,
    warn_window,
    window_keep,
)
from tinylm.generate.stream import TextStream
from tinylm.tokenizers.base import Tokenizer


@dataclass
class TokenEvent:
    """One new token of one row, as the engine produces it: what streaming consumers see."""

    row: int
    token: int
    logprob: float
    text: str  # text this token made certain ("" while held back)
    finish_reason: FinishReason | None = None  # set on the row's last event


def encode_prompts(tokenizer: Tokenizer, prompts: Sequence[str], start_ids: Sequence[int] = ()) -> list[list[int]]:
    """Each prompt's token ids after ``start_ids`` (e.g. `Run.start_ids`: what documents began after in training)."""
    out = [list(start_ids) + tokenizer.encode(p) for p in prompts]
    if any(not ids for ids in out):
        raise TinyLMError("an empty prompt gives the model nothing to continue from: pass start_ids "
                          "(a run's start_ids: the EOS or BOS its documents began after) or some text")
    return out


# ----- the engine --------------------------------------------------------------------------------


@dataclass
class _Row:
    """The state of one sample while it is generated."""

    seq: list[int]  # the prompt then the new tokens
    start: int = 0  # where the model's current window begins in seq
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    stream: TextStream | None = None  # tokens -> text, with the stop strings
    finish_reason: FinishReason | None = None
    stop: int | str | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


class Engine:
    """Batched generation with a static KV cache; `events` streams tokens, `generate` collects them.

    ``model`` is a `tinylm.model.GPT` (or anything with its forward signature and a ``config``
    with block_size, n_layer, kv_heads and head_dim). ``tokenizer`` is needed for text and stop
    strings; without it, completions carry token ids only and ``text`` is "". ``vocab_size``
    limits sampling to ids below it (default: the tokenizer's vocabulary, when the model's
    output layer is larger, as with a vocabulary padded to a multiple of 64). A GPT decodes through
    `tinylm.generate.fast.StaticDecoder` (its weights laid out for one-token steps), other
    families through their own forward; ``compile`` compiles the GPT's one-token step.
    ``long_prompts`` is what happens to a prompt longer than the context (`tinylm.generate.request`):
    read whole, the window sliding as usual ("slide"), or cut to its last block_size tokens with a
    warning ("cut", what `generate` and `stream` ask for).
    ``prefix_cache`` (`tinylm.generate.prefix_cache.PrefixCache`): a lone prompt reuses the keys and values of
    the longest prefix it shares with a sequence read before, and what this engine reads is kept there for the
    next (batches of several rows read everything, and store nothing). ``prompt_tokens_run`` counts the prompt
    tokens the first window ran through the model.
    """

    def __init__(self, model: nn.Module, params: SamplingParams, tokenizer: Tokenizer | None = None,
                 vocab_size: int | None = None, compile: bool = False, long_prompts: LongPrompts = "slide",
                 prefix_cache: PrefixCache | None = None) -> None:
        if params.num_beams != 1:
            raise TinyLMError("the sampling engine decodes one path per sample; "
                              "use tinylm.generate.beam for num_beams > 1")
        self.model = model
        self.params = params
        self.tokenizer = tokenizer
        self.block_size: int = model.config.block_size
        self.keep = window_keep(params, self.block_size)
        self.vocab_size = vocab_size if vocab_size is not None else (tokenizer.vocab_size if tokenizer else None)
        self.device = next(model.parameters()).device
        self.rules = RequestRules(model, tokenizer, limit=self.vocab_size)
        self.long_prompts = long_prompts
        self.stop_ids = self.rules.stop_ids(params)
        # (V,) or None: ids past vocab_size, and the tokenizer's padding, BOS, reserved ids and <unk>
        self.excluded = self.rules.excluded(self.stop_ids)
        self.compile = compile
        self.decoder: StaticDecoder | CachedDecoder | None = None
        self.warned = False
        self.prefix_cache = prefix_cache
        self.prompt_tokens_run = 0

    # -- public --------------------------------------------------------------------------------

    def generate(self, prompts: Sequence[Sequence[int]]) -> list[Completion]:
        """Completions for token-id prompts: ``num_samples`` per prompt, prompt by prompt."""
        rows = self._rows(prompts)
        for _ in self._run(rows):
            pass
        return [self._completion(r, row) for r, row in enumerate(rows)]

    def events(self, prompts: Sequence[Sequence[int]]) -> Iterator[TokenEvent]:
        """Each new token of each row as it is generated (row = prompt_index * num_samples + sample_index)."""
        return self._run(self._rows(prompts))

    # -- the loop ------------------------------------------------------------------------------

    def _rows(self, prompts: Sequence[Sequence[int]]) -> list[_Row]:
        checked, said = self.rules.prompts(prompts, self.long_prompts)
        for warning in said:
            warnings.warn(warning, stacklevel=4)  # at the caller of `generate` or `stream`
        rows = []
        for ids in checked:
            for _ in range(self.params.num_samples):
                stream = TextStream(self.tokenizer, self.params.stop) if self.tokenizer is not None else None
                rows.append(_Row(seq=list(ids), stream=stream))
        return rows

    @torch.inference_mode()
    def _run(self, rows: list[_Row]) -> Iterator[TokenEvent]:
        params = self.params
        if params.max_new_tokens == 0:
            for row in rows:
                row.finish_reason = "length"
            return
        n = params.num_samples
        generators = None if params.greedy else prompt_generators(
            params.seed, len(rows) // n, n, self.device, prompts=[rows[p].seq for p in range(0, len(rows), n)])
        was_training = self.model.training
        self.model.eval()
        try:
            yield from self._decode(rows, generators)
            self._remember(rows)
        except GeneratorExit:  # a reader stopped early: what was read so far is still valid
            self._remember(rows)
            raise
        finally:
            self.model.train(was_training)
            if isinstance(self.decoder, StaticDecoder):
                self.decoder.command_threads()

    def _decode(self, rows: list[_Row], generators: list[torch.Generator] | None) -> Iterator[TokenEvent]:
        """The decoding loop: the first window, then a sample and a step per new token until every row is done."""
        params = self.params
        logits = self._start_window(rows, first=True)  # (B, V)
        made = 0  # new tokens so far
        while True:
            if self.excluded is not None:
                logits.masked_fill_(self.excluded, float("-inf"))
            tokens = sample(logits, params, generators)  # (B,)
            logprobs = token_logprobs(logits, tokens)  # (B,)
            made += 1
            last_step = made == params.max_new_tokens
            new_tokens = tokens.tolist()
            for r, (token, logprob) in enumerate(zip(new_tokens, logprobs.tolist())):
                if not rows[r].done:
                    yield self._accept(r, rows[r], token, logprob, last_step)
            if all(row.done for row in rows) or last_step:
                return
            for row, token in zip(rows, new_tokens):
                row.seq.append(token)
            # a lone greedy row, compiled: several tokens a call where that measured faster (`greedy_ahead`)
            while params.greedy and len(rows) == 1 and params.max_new_tokens - made >= fast.GREEDY_TOKENS > 0 \
                    and isinstance(self.decoder, StaticDecoder):
                start = self.decoder.length
                ahead = self.decoder.greedy_ahead(tokens, self.excluded)
                if ahead is None:
                    break
                for j, (token, logprob) in enumerate(zip(*ahead)):
                    made += 1
                    yield self._accept(0, rows[0], token, logprob, made == params.max_new_tokens)
                    if rows[0].done:  # the cache keeps the tokens before this one
                        self.decoder.truncate(start + j + 1)
                        return
                    rows[0].seq.append(token)
                tokens = torch.tensor(ahead[0][-1:], device=self.device)
            if self.decoder.length + 1 > self.decoder.max_len:
                logits = self._start_window(rows)  # the window overflowed: cut and recompute
            else:
                logits = self._step(tokens)

    def _remember(self, rows: list[_Row]) -> None:
        """Keep a lone row's window (the tokens the cache holds: all but the newest) in the prefix cache."""
        if self.prefix_cache is not None and len(rows) == 1 and self.decoder is not None:
            window = rows[0].seq[rows[0].start:]
            if self.decoder.length == len(window):
                self.prefix_cache.remember(self.decoder, 0, window)

    def _accept(self, r: int, row: _Row, token: int, logprob: float, last_step: bool) -> TokenEvent:
        """Record a row's new token; decide whether the row is done; the text it releases."""
        row.tokens.append(token)
        row.logprobs.append(logprob)
        piece, reason, stop = accept_token(row.stream, token, self.stop_ids, last_step)
        if reason is not None:
            row.finish_reason, row.stop = reason, stop
        return TokenEvent(r, token, logprob, piece, row.finish_reason)

    def _start_window(self, rows: list[_Row], first: bool = False) -> Tensor:
        """(Re)build the cache: each row's window per `context_start`, left-padded, prefilled. Logits (B, V)."""
        windows = []
        for row in rows:
            if row.done:
                windows.append(row.seq[-1:])  # finished rows only ride along: one token is enough
                continue
            start = context_start(len(row.seq), self.block_size, self.keep)
            if start > row.start and not self.warned:
                warn_window(self.block_size, self.keep)
                self.warned = True
            row.start = start
            windows.append(row.seq[start:])
        idx, mask = left_pad(windows, self.device)  # (B, T), (B, T)
        B, T = idx.shape
        if first:
            # the longest window plus every new token, but never more than the model's context
            capacity = min(self.block_size, T + self.params.max_new_tokens)
            self.decoder = make_decoder(self.model, B, capacity, self.compile)
            if self.prefix_cache is not None and B == 1:
                logits, reused = self.prefix_cache.resume(self.decoder, windows[0])
                self.prompt_tokens_run += T - reused
            else:
                logits = self.decoder.start(idx, mask)
                self.prompt_tokens_run += int(mask.sum())
            if isinstance(self.decoder, StaticDecoder) and self.params.max_new_tokens > 1:
                self.decoder.prepare_steps()  # (a thread setting measured now is said before the first token)
            return logits
        return self.decoder.start(idx, mask)

    def _step(self, tokens: Tensor) -> Tensor:
        """Feed the sampled tokens (B,); logits (B, V) for the token after them."""
        return self.decoder.step(tokens)

    def _completion(self, r: int, row: _Row) -> Completion:
        n = self.params.num_samples
        return Completion(text=row.stream.text if row.stream else "", token_ids=row.tokens, logprobs=row.logprobs,
                          finish_reason=row.finish_reason or "length", prompt_index=r // n, sample_index=r % n,
                          stop=row.stop)


def check_compile(params: SamplingParams, compile: bool) -> None:
    """Refuse a compiled step with beam search: only sampling and greedy decoding have a step to compile."""
    if compile and params.num_beams > 1:
        raise TinyLMError("--compile speeds up sampling and greedy decoding; beam search runs through the model's "
                          "own forward: drop --compile or --num-beams")


def generate(
    model: nn.Module,
    tokenizer: Tokenizer,
    prompts: Sequence[str] | str,
    params: SamplingParams | None = None,
    *,
    start_ids: Sequence[int] = (),
    compile: bool = False,
) -> list[Completion]:
    """Complete each prompt ``params.num_samples`` times: the one call behind `tinylm sample`.

    Returns the completions prompt by prompt (prompt i's sample j at i * num_samples + j).
    ``start_ids`` go before every prompt (pass a run's `start_ids`: the token documents began
    after in training); an empty prompt then samples a document from the start. Sampling, beam
    search (``params.num_beams > 1``), stopping and the context window follow ``params``;
    ``compile`` compiles a GPT's one-token step (`Engine`); beam search, which runs through the
    model's own forward, refuses it (`check_compile`).

        run = load_run("runs/tiny")
        out = generate(run.model, run.tokenizer, "ROMEO:", SamplingParams(temperature=0.8, seed=1),
                       start_ids=run.start_ids)
        print(out[0].text, out[0].finish_reason)
    """
    params = params if params is not None else SamplingParams()
    check_compile(params, compile)
    if isinstance(prompts, str):
        prompts = [prompts]
    ids = encode_prompts(tokenizer, prompts, start_ids)
    if params.num_beams > 1:
        ids = [keep_prompt(p, model.config.block_size) for p in ids]
        return [c for i, p in enumerate(ids)
                for c in beam_search_completions(model, tokenizer, p, params, prompt_index=i)]
    return Engine(model, params, tokenizer, compile=compile, long_prompts="cut").generate(ids)


def stream(
    model: nn.Module,
    tokenizer: Tokenizer,
    prompt: str,
    params: SamplingParams,
    *,
    start_ids: Sequence[int] = (),
    compile: bool = False,
) -> Iterator[str]:
    """Yield the text of one completion of ``prompt`` in pieces, as the tokens are generated.

    Only for a single sample (``params.num_samples == 1``, no beam search: a beam's text is not
    final until the search ends). ``"".join(stream(...))`` equals ``generate(...)[0].text``.
    """
    check_compile(params, compile)
    if params.num_samples != 1 or params.num_beams != 1:
        raise TinyLMError("streaming shows one sample as it is written: use num_samples = 1 and num_beams = 1")
    engine = Engine(model, params, tokenizer=tokenizer, compile=compile, long_prompts="cut")
    for event in engine.events(encode_prompts(tokenizer, [prompt], start_ids)):
        if event.text:
            yield event.text
