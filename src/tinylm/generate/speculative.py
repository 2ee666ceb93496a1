"""Speculative decoding for one sequence: a cheap draft guesses k tokens, the model checks them in one pass.

Decoding one token costs one forward pass of the model, however few numbers it reads. A *draft*
(something much cheaper: a lookup in the text so far, a small model) proposes the next k tokens
d_1..d_k; the model then reads the last accepted token and the k drafts in ONE forward pass over
its KV cache, which gives its distributions p_1..p_{k+1} after each prefix. The draft's guesses
are kept or thrown away by the acceptance rule of Leviathan et al. / Chen et al. (2023), which
makes the output follow the model's own distribution exactly, whatever the draft proposes:

    for i = 1..k:  accept d_i with probability min(1, p_i(d_i) / q_i(d_i))
                   on rejection: draw from normalize(max(0, p_i - q_i)) and stop the round
    all k accepted: draw one bonus token from p_{k+1}

q_i is the draft's distribution for d_i (one-hot for a deterministic draft such as the prompt
lookup, so a draft is kept with probability p_i(d_i)). Why it is exact: token x comes out of
step i with probability min(p, q)(x) (proposed and kept) + (1 - sum min(p, q)) * max(0, p - q)(x)
/ sum max(0, p - q) (rejected, then redrawn); since sum max(0, p - q) = 1 - sum min(p, q), that
is min(p, q)(x) + max(0, p - q)(x) = p(x). p is the model's distribution after the request's
temperature and filters (`tinylm.generate.sampling.sampling_distribution`), so greedy decoding
(p one-hot on the argmax) keeps exactly the drafts equal to the argmax and gives the engine's
tokens.

The cache holds every token but the last one ("pending"); a round feeds pending + drafts, so a
round of k drafts writes k + 1 positions, and on rejection the cache is cut back to pending + the
accepted drafts (`StaticDecoder.truncate` for a GPT, whose static cache forgets by length;
`KVCache.truncate` for a GPT with a bigram-hash table). The context window follows
`context_start`, as in the engine: drafts are checked only while they fit in the current window,
then the window is cut and recomputed. With ``compile``, every round feeds k + 1 tokens (padded),
so one compiled graph serves them all. Only models whose cache is a KV cache (the Transformers)
can roll back; an RNN's state or an n-gram's history cannot, so those are refused as the model
(any of them can be a draft).

k adapts: one more after a round where all drafts were kept (up to ``k``), back to one more
than the drafts kept after a rejection. Whether drafting pays depends on the draft and on the
machine: a pass over k + 1 tokens costs about one token's pass where reading the weights is
the bottleneck (big models), but up to k + 1 times as much where the arithmetic is (small
models on a CPU whose BLAS multiplies a few rows slowly). So `Pacer` measures it: it times the
plain steps and the drafted rounds, and after every 4 drafted rounds compares the tokens per
second of both; when drafting was slower it decodes plainly for a while (32 steps, doubling
each time it is still slower, up to 512) and then tries again. Greedy output does not depend on
these choices; sampled output follows the model's distribution either way, though with a seed
the text can differ from run to run, since the choices depend on measured time.
`SpeculativeStats` counts rounds, proposed and
accepted drafts, and the model's forward passes.

    completion, stats = speculative_generate(run.model, ids, SamplingParams(temperature=0), PromptLookupDraft(),
                                             k=4, tokenizer=run.tokenizer)
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict, Unpack

import numpy as np

import torch
from torch import Tensor, nn

import tinylm.run
from tinylm.data.shards import ShardSet
from tinylm.errors import TinyLMError
from tinylm.generate.cache import KVCache
from tinylm.generate.fast import StaticDecoder, make_decoder
from tinylm.generate.request import PreparedRequest, RequestRules
from tinylm.generate.sampling import SamplingParams, make_generators, sampling_distribution
from tinylm.generate.steps import Completion, FinishReason, accept_token, context_start, warn_window, window_keep
from tinylm.generate.rounds import FIRST_PAUSE, ROUNDS_PER_CHECK, Pacer, check_drafts, draw_one
from tinylm.generate.stream import TextStream
from tinylm.model import NGramLM, NGramModel
from tinylm.tokenizers.base import Tokenizer, check_same_tokenizer

@dataclass
class SpeculativeStats:
    """What the drafts achieved: ``accepted / proposed`` is the acceptance rate; ``tokens / forward_passes``
    how many tokens each pass of the model bought (1 without a draft)."""

    rounds: int = 0  # rounds with at least one draft token
    proposed: int = 0  # draft tokens checked by the model
    accepted: int = 0  # draft tokens kept
    forward_passes: int = 0  # calls of the model (prefills included)
    tokens: int = 0  # tokens generated

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0


# ----- drafts: propose(seq, k, excluded, params, generator) -> (tokens, q (n, V) or None for one-hot) -----


class PromptLookupDraft:
    """Propose what followed the last time the text's final n tokens occurred (n = ``max_ngram``..1).

    Deterministic (q is one-hot). On repetitive text (code, lists, quoting the prompt) the guesses are
    often right; on fresh text it finds nothing and proposes nothing.
    """

    def __init__(self, max_ngram: int = 3) -> None:
        if max_ngram < 1:
            raise TinyLMError(f"the prompt lookup needs n-grams of at least 1 token, got {max_ngram}")
        self.max_ngram = max_ngram

    def propose(self, seq: Sequence[int], k: int, excluded: Tensor | None, params: SamplingParams,
                generator: torch.Generator | None) -> tuple[list[int], Tensor | None]:
        for n in range(min(self.max_ngram, len(seq) - 1), 0, -1):
            tail = list(seq[-n:])
            # the latest earlier occurrence: its last token must end before the tail's start + n - 1
            for start in range(len(seq) - n - 1, -1, -1):
                if list(seq[start:start + n]) == tail:
                    return list(seq[start + n:start + n + k]), None
        return [], None


class ModelDraft:
    """A draft model: ``next_logits(prefix ids) -> logits (V,)``, sampled with the request's filters (q).

    `ModelDraft.of(model)` wraps any tinylm model (a smaller GPT, the run's n-gram `NGramLM`) by
    reading the last ``block_size`` tokens afresh each time: simple and fine for small drafts.
    """

    def __init__(self, next_logits: Callable[[Sequence[int]], Tensor]) -> None:
        self.next_logits = next_logits

    @classmethod
    def of(cls, model: nn.Module) -> ModelDraft:
        device = next(model.parameters()).device
        block_size = model.config.block_size
        model.eval()

        @torch.inference_mode()
        def next_logits(prefix: Sequence[int]) -> Tensor:
            idx = torch.tensor([list(prefix[-block_size:])], dtype=torch.long, device=device)  # (1, T)
            logits, _ = model(idx)
            return logits[0, -1]  # (V,)

        return cls(next_logits)

    def propose(self, seq: Sequence[int], k: int, excluded: Tensor | None, params: SamplingParams,
                generator: torch.Generator | None) -> tuple[list[int], Tensor | None]:
        prefix, tokens, qs = list(seq), [], []
        V = excluded.numel() if excluded is not None else None
        for _ in range(k):
            logits = self.next_logits(prefix).float().flatten()
            if V is not None:
                logits = _fit(logits, V).masked_fill(excluded.to(logits.device), float("-inf"))
            q = sampling_distribution(logits[None], params)[0]  # (V,)
            token = draw_one(q, generator)
            tokens.append(token)
            qs.append(q)
            prefix.append(token)
        return tokens, (torch.stack(qs) if qs else None)


class NGramDraft:
    """Propose with an n-gram model counted on the model's own training tokens (`ngram_draft`).

    Greedy decoding drafts the n-gram's most likely token at each step (q one-hot); sampling draws
    from its distribution after the request's temperature and filters (q), which the acceptance
    rule compares with the model's. A lookup costs well under a millisecond (numpy over the
    counts), far less than a pass of the model.
    """

    def __init__(self, ngram: NGramModel) -> None:
        self.ngram = ngram
        self.context = ngram.order - 1

    def propose(self, seq: Sequence[int], k: int, excluded: Tensor | None, params: SamplingParams,
                generator: torch.Generator | None) -> tuple[list[int], Tensor | None]:
        context = list(seq[-self.context:]) if self.context else []
        V = excluded.numel() if excluded is not None else self.ngram.vocab_size
        tokens, qs = [], []
        with np.errstate(divide="ignore"):
            for _ in range(k):
                probs = self.ngram.next_token_distribution(context[-self.context:] if self.context else [])
                logits = _fit(torch.from_numpy(np.log(probs)).float(), V)  # (V,)
                if excluded is not None:
                    logits = logits.masked_fill(excluded.cpu(), float("-inf"))
                if generator is None:
                    token = int(logits.argmax())
                else:
                    q = sampling_distribution(logits[None], params)[0]  # (V,)
                    token = draw_one(q, generator)
                    qs.append(q)
                tokens.append(token)
                context.append(token)
        if not qs:  # greedy: q is one-hot
            return tokens, None
        q = torch.stack(qs)  # (k, V), on the CPU where numpy made it
        return tokens, (q.to(excluded.device) if excluded is not None else q)


Draft = PromptLookupDraft | ModelDraft | NGramDraft

# the n-gram draft a run keeps in its folder (run.NGRAM_DRAFT_FILE), counted on first use from the run's
# training shards
NGRAM_DRAFT_FILE = tinylm.run.NGRAM_DRAFT_FILE
NGRAM_DRAFT_ORDER = 3  # of 3, 4, 5 on the default run, the one whose top token agrees most with the model's


def ngram_draft(run_dir: str | os.PathLike, tokenizer: Tokenizer, order: int = NGRAM_DRAFT_ORDER,
                log: Callable[[str], None] | None = None) -> NGramModel:
    """The run's n-gram draft: ``draft-ngram.npz`` in the run folder, or counted now from its training shards and kept there.

    Counting reads the shards run.json records (the tokens the model was trained on), with
    Kneser-Ney smoothing, in a second or two for Shakespeare. An n-gram run's own model
    (``tinylm train --model ngram``) can be the draft instead: pass its folder as the draft.
    """
    path = Path(run_dir) / NGRAM_DRAFT_FILE
    if path.is_file():
        ngram = NGramModel.load(path)
        if ngram.vocab_size != tokenizer.vocab_size:
            raise TinyLMError(f"{path} counts another vocabulary ({ngram.vocab_size} ids, the tokenizer has "
                              f"{tokenizer.vocab_size}): delete it and it is counted again")
        return ngram
    data = tinylm.run.read_run_info(run_dir).get("data") or {}
    shards_dir = data.get("dir")
    if not shards_dir or not Path(shards_dir).is_dir():
        where = f"its training shards ({shards_dir}) are gone" if shards_dir else "it records no training shards"
        raise TinyLMError(f"no n-gram draft for {run_dir}: {where}. Prepare them again with `tinylm prepare` and "
                          f"count one with `tinylm train --model ngram`, then pass that run folder as --draft")
    shards = ShardSet.open(shards_dir)
    check_same_tokenizer(shards.meta["tokenizer"]["fingerprint"], tokenizer, f"the shards in {shards_dir} were made "
                         "with another tokenizer than the run's", "the n-gram draft must count the model's own tokens")
    started = time.perf_counter()
    ngram = NGramModel.fit_shards(shards, order, smoothing="kn")
    ngram.save(path)
    if log is not None:
        log(f"counted a {order}-gram draft from {shards_dir} in {time.perf_counter() - started:.1f} s; kept in {path}")
    return ngram


def load_draft(spec: str, run: tinylm.run.Run, checkpoint: str = "best",
               log: Callable[[str], None] | None = None) -> Draft:
    """The draft `tinylm sample --draft` names for ``run``'s model.

    "ngram": the run's own n-gram (`ngram_draft`); "prompt": the prompt lookup; a run folder: its
    model drafts (an n-gram run's counts directly, a Transformer through its forward). A draft run
    must share the model's tokenizer (the same fingerprint): its ids must mean the same text.
    """
    if spec == "prompt":
        return PromptLookupDraft()
    if spec == "ngram":
        return NGramDraft(ngram_draft(run.path, run.tokenizer, log=log))
    other = tinylm.run.load_run(spec, checkpoint=checkpoint)
    check_same_tokenizer(other.tokenizer, run.tokenizer, f"the draft run {spec} has another tokenizer than the model's",
                         "a draft must share the model's tokenizer (train it on the same tokenizer.json)")
    if isinstance(other.model, NGramLM):
        return NGramDraft(other.model.ngram)
    return ModelDraft.of(other.model)


def _fit(logits: Tensor, V: int) -> Tensor:
    """A draft's logits over exactly the model's V ids (a padded output layer is cut, a smaller one padded)."""
    if logits.numel() >= V:
        return logits[:V]
    return torch.cat([logits, logits.new_full((V - logits.numel(),), float("-inf"))])


# ----- the loop ------------------------------------------------------------------------------------


@dataclass
class SpeculativeEvent:
    """One new token as speculative decoding produces it (what a stream shows)."""

    token: int
    logprob: float
    text: str  # the text this token made certain ("" while held back)
    finish_reason: FinishReason | None = None  # set on the last token


class SpeculativeOptions(TypedDict, total=False):
    """`speculative_generate`'s keyword options, `speculative_events`'s keywords of the same names."""

    tokenizer: Tokenizer | None
    adaptive: bool
    compile: bool


def speculative_generate(model: nn.Module, prompt_ids: Sequence[int], params: SamplingParams, draft: Draft,
                         k: int = 4, **options: Unpack[SpeculativeOptions]) -> tuple[Completion, SpeculativeStats]:
    """One completion of ``prompt_ids``, distributed exactly as the engine's, checking up to ``k`` drafts a pass.

    ``options`` are `speculative_events`'s: ``tokenizer`` (text and stop strings), ``adaptive``, ``compile``.
    """
    stats = SpeculativeStats()
    tokenizer = options.get("tokenizer")
    stream = TextStream(tokenizer, params.stop) if tokenizer is not None else None
    tokens, logprobs, finish, stop = [], [], None, None
    for event in speculative_events(model, prompt_ids, params, draft, k, stats=stats, stream=stream, **options):
        tokens.append(event.token)
        logprobs.append(event.logprob)
        finish = event.finish_reason
    if stream is not None and stream.stopped_by is not None:
        stop = stream.stopped_by
    elif finish == "stop" and tokens:
        stop = tokens[-1]
    completion = Completion(text=stream.text if stream else "", token_ids=tokens, logprobs=logprobs,
                            finish_reason=finish or "length", stop=stop)
    return completion, stats


def speculative_events(
    model: nn.Module,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    draft: Draft,
    k: int = 4,
    *,
    tokenizer: Tokenizer | None = None,
    adaptive: bool = True,
    compile: bool = False,
    stats: SpeculativeStats | None = None,
    stream: TextStream | None = None,
) -> Iterator[SpeculativeEvent]:
    """`speculative_generate` one token at a time, as the rounds keep them (for streaming).

    ``tokenizer`` turns tokens into text and reads stop strings (without one: token ids only);
    ``adaptive=False`` drafts in every round (`Pacer`); ``stats`` (if given) is updated as the rounds go;
    ``stream`` turns tokens into text (default: a new one over ``tokenizer``, when there is one).
    ``compile`` compiles the model's step (a `StaticDecoder`): one graph for a round of ``k`` drafts
    (padded) and one for a single token.
    """
    if params.num_beams != 1 or params.num_samples != 1:
        raise TinyLMError("speculative decoding makes one sample of one prompt: use num_beams = 1 and num_samples = 1")
    if not isinstance(k, int) or k < 1:
        raise TinyLMError(f"the draft length k must be an integer >= 1, got {k!r}")
    # a long prompt is read as `generate` reads it: its last block_size tokens
    request = RequestRules(model, tokenizer).prepare([prompt_ids], params, long_prompts="cut")
    for warning in request.warnings:
        warnings.warn(warning, stacklevel=2)
    stats = stats if stats is not None else SpeculativeStats()
    if stream is None and tokenizer is not None:
        stream = TextStream(tokenizer, params.stop)
    return _rounds(model, request, params, draft, k, adaptive, compile, stats, stream)


@torch.inference_mode()
def _rounds(model: nn.Module, request: PreparedRequest, params: SamplingParams, draft: Draft, k: int,
            adaptive: bool, compile: bool, stats: SpeculativeStats,
            stream: TextStream | None) -> Iterator[SpeculativeEvent]:
    block_size = model.config.block_size
    keep = window_keep(params, block_size)
    device = next(model.parameters()).device
    seq = list(request.prompts[0])
    stop_ids = request.stop_ids
    excluded = request.draft_mask()
    generator = None if params.greedy else make_generators(params.seed, 1, device)[0]
    capacity = min(block_size, len(seq) + params.max_new_tokens)
    decoder = make_decoder(model, 1, capacity, compile, draft_k=k)  # with room for a padded round
    if not isinstance(decoder, StaticDecoder) and not isinstance(decoder.cache, KVCache):
        raise TinyLMError("speculative decoding rolls the model's KV cache back; this model family keeps "
                          "another kind of state: use it as the draft, or decode without one")
    capacity = decoder.max_len
    n_new = 0
    start, warned = -1, False  # where the cache's window begins in seq; -1: no window yet
    pacer = Pacer(k, adaptive)
    was_training = model.training
    model.eval()
    try:
        while n_new < params.max_new_tokens:
            # the window: cut and recompute when the pending token no longer fits (or at the start)
            if start < 0 or len(seq) - start > capacity:
                start = context_start(len(seq), block_size, keep)
                if start > 0 and not warned:
                    warn_window(block_size, keep)
                    warned = True
                decoder.reset()
                if len(seq) - 1 > start:  # everything but the pending token
                    decoder.extend(torch.tensor([seq[start:-1]], device=device))
                    stats.forward_passes += 1
            room = capacity - (len(seq) - start)  # drafts that fit in the window after the pending token
            started = time.perf_counter()
            n_draft = min(pacer.drafts(), room, params.max_new_tokens - n_new - 1)
            drafts, q = draft.propose(seq, n_draft, excluded, params, generator) if n_draft > 0 else ([], None)
            drafts = drafts[:max(n_draft, 0)]
            new, kept, logprob_rows = check_drafts(decoder, seq, drafts, q, excluded, params, generator, pad_to=k + 1)
            stats.forward_passes += 1
            if drafts:
                stats.rounds += 1
                stats.proposed += len(drafts)
                stats.accepted += kept
            pacer.record(len(drafts), kept, time.perf_counter() - started)
            for i, token in enumerate(new):
                n_new += 1
                stats.tokens += 1
                seq.append(token)
                piece, finish, _ = accept_token(stream, token, stop_ids, n_new == params.max_new_tokens)
                yield SpeculativeEvent(token, float(logprob_rows[i, token]), piece, finish)
                if finish is not None:
                    return
    finally:
        model.train(was_training)
        if isinstance(decoder, StaticDecoder):
            decoder.command_threads()
