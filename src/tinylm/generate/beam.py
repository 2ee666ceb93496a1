"""Beam search: decoding as a search for the most probable continuation, not a walk.

A continuation x_1..x_n has log-probability sum_t log p(x_t | x_<t). Greedy decoding picks the
best *next* token each time, a heuristic: a token that looks second-best now can lead to a much
more likely path (p = 0.4 then 0.9 beats 0.6 then 0.3). Searching all |V|^n paths is hopeless;
beam search keeps the ``num_beams`` best partial paths (the beams) at every step:

1. extend every beam by every token: score(beam + x) = score(beam) + log p(x | beam);
2. keep the best 2 * num_beams extensions; one that ends in a stop id (EOS) becomes a finished
   hypothesis, the best num_beams of the others become the new beams;
3. stop after ``max_new_tokens``, or once num_beams hypotheses are finished and no beam scores
   better than the worst of them (a heuristic: a beam could still improve its normalised score).

Sums of log-probabilities only fall as a path grows, which favours short paths; **length
normalisation** ranks finished paths by sum(log p) / n^alpha instead (``length_penalty`` alpha:
0 = raw sums, 1 = mean log-probability per token), as in Wu et al. (2016) without their +5.

The beams are a batch of rows in one KV cache; when a beam's extension is kept, its cached keys
and values are copied to its new row (`KVCache.reorder`). Stop strings are applied to the final
texts only (the search itself ends paths at stop ids). The sampling knobs (temperature, top-k,
top-p, min-p, seed) do not apply: the search is deterministic.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from tinylm.generate.cache import KVCache, cache_for
from tinylm.generate.sampling import SamplingParams, excluded_mask
from tinylm.generate.steps import Completion, context_start, decode_one_token, prefill, warn_window, window_keep
from tinylm.tokenizers.base import Tokenizer, default_stop_ids


@dataclass
class Beam:
    """A path: the new tokens, the model's log-probability of each, and whether it has ended."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    stop: int | None = None  # the stop id that finished it; None while open or when cut by length

    @property
    def logprob(self) -> float:
        """log p(path | prompt) = the sum of the tokens' log-probabilities."""
        return sum(self.logprobs)

    def score(self, length_penalty: float) -> float:
        """The ranking score: sum(log p) / n^alpha."""
        return self.logprob / max(len(self.tokens), 1) ** length_penalty

    def extend(self, token: int, logprob: float) -> Beam:
        return Beam(self.tokens + [token], self.logprobs + [logprob])


@torch.inference_mode()
def beam_search(
    model: nn.Module,
    prompt: Sequence[int],
    num_beams: int,
    max_new_tokens: int,
    *,
    length_penalty: float = 1.0,
    stop_ids: Sequence[int] = (),
    vocab_size: int | None = None,
    excluded: Tensor | None = None,
    keep: int | None = None,
    use_cache: bool = True,
) -> list[Beam]:
    """The best paths found after ``prompt``, best first (at most ``num_beams``).

    No path takes an id from ``vocab_size`` on, nor one where ``excluded`` (V,) is True
    (`tinylm.generate.sampling.excluded_mask`); ``keep`` is the window policy's
    ``window_keep`` (see `tinylm.generate.engine.context_start`). ``use_cache=False`` recomputes
    every beam from scratch at every step: the reference the cached search is tested against.
    """
    block_size = model.config.block_size
    device = next(model.parameters()).device
    past = excluded_mask(None, model.config.vocab_size, device=device, limit=vocab_size)  # ids from vocab_size on
    if past is not None:  # they join the excluded ones: one mask for every step
        excluded = past if excluded is None else excluded | past
    keep = window_keep(SamplingParams(window_keep=keep), block_size)
    stop_ids = set(stop_ids)
    prompt = list(prompt)
    warned = False

    def windows(beams: list[Beam]) -> Tensor:
        """Every beam's window, (k, T): all beams have the same length, so no padding is needed."""
        nonlocal warned
        start = context_start(len(prompt) + len(beams[0].tokens), block_size, keep)
        if start > 0 and not warned:
            warn_window(block_size, keep)
            warned = True
        return torch.tensor([(prompt + b.tokens)[start:] for b in beams], dtype=torch.long, device=device)

    def start_window(beams: list[Beam]) -> tuple[KVCache | None, Tensor]:
        idx = windows(beams)  # (k, T)
        if not use_cache:
            return None, model(idx)[0][:, -1]  # (k, V), recomputed from scratch
        cache = cache_for(model, len(beams), min(block_size, idx.size(1) + max_new_tokens))
        return cache, prefill(model, idx, cache)

    was_training = model.training
    model.eval()
    try:
        alive, finished = [Beam()], []
        cache, logits = start_window(alive)  # logits (k, V)
        for step in range(max_new_tokens):
            alive, parents, finished = select_beams(alive, finished, logits, num_beams, length_penalty,
                                                    stop_ids, excluded)
            if not alive or step == max_new_tokens - 1:
                break
            if len(finished) == num_beams:
                best_open = max(b.score(length_penalty) for b in alive)
                if best_open <= finished[-1].score(length_penalty):
                    break
            if cache is None or cache.length + 1 > cache.max_len:
                cache, logits = start_window(alive)  # no cache, or the window overflowed
            else:
                # each kept beam's cached keys and values move to its new row, then the new tokens go in
                cache.reorder(torch.tensor(parents, device=device))
                tokens = torch.tensor([b.tokens[-1] for b in alive], dtype=torch.long, device=device)  # (k,)
                logits = decode_one_token(model, tokens, cache)
        everything = finished + alive  # paths still open: cut by the token limit (or outscored at an early stop)
        return sorted(everything, key=lambda x: x.score(length_penalty), reverse=True)[:num_beams]
    finally:
        model.train(was_training)


def select_beams(alive: list[Beam], finished: list[Beam], logits: Tensor, num_beams: int, length_penalty: float,
                 stop_ids: set[int], excluded: Tensor | None = None) -> tuple[list[Beam], list[int], list[Beam]]:
    """One step of the search: (the new beams, the row each came from, the finished paths, best first).

    ``logits`` (k, V) are the next-token logits of the k alive beams.
    """
    logp = torch.log_softmax(logits.float(), dim=-1)  # (k, V)
    if excluded is not None:
        logp.masked_fill_(excluded, float("-inf"))
    sums = torch.tensor([b.logprob for b in alive], dtype=logp.dtype, device=logp.device)  # (k,)
    scores = (sums[:, None] + logp).flatten()  # (k * V,): every one-token extension
    top = torch.topk(scores, min(2 * num_beams, int(torch.isfinite(scores).sum())))
    V = logp.size(-1)
    new_alive, parents, finished = [], [], list(finished)
    for flat in top.indices.tolist():
        b, token = divmod(flat, V)
        beam = alive[b].extend(token, float(logp[b, token]))
        if token in stop_ids:
            beam.stop = token
            finished.append(beam)
        elif len(new_alive) < num_beams:
            new_alive.append(beam)
            parents.append(b)
    finished = sorted(finished, key=lambda x: x.score(length_penalty), reverse=True)[:num_beams]
    return new_alive, parents, finished


def beam_search_completions(model: nn.Module, tokenizer: Tokenizer, prompt: Sequence[int], params: SamplingParams,
                            prompt_index: int = 0) -> list[Completion]:
    """The best ``params.num_samples`` beams as `Completion`s (what `generate` returns for num_beams > 1)."""
    stop_ids = params.stop_ids if params.stop_ids is not None else default_stop_ids(tokenizer)
    device = next(model.parameters()).device
    excluded = excluded_mask(tokenizer, model.config.vocab_size, stop_ids, device)
    beams = beam_search(model, prompt, params.num_beams, params.max_new_tokens, length_penalty=params.length_penalty,
                        stop_ids=stop_ids, excluded=excluded, keep=params.window_keep)
    out = []
    for j, beam in enumerate(beams[:params.num_samples]):
        text_ids = beam.tokens[:-1] if beam.stop is not None else beam.tokens
        text = tokenizer.decode(text_ids)
        reason, stop = ("stop", beam.stop) if beam.stop is not None else ("length", None)
        found = [(text.find(s), s) for s in params.stop if s in text]
        if found:
            position, stop = min(found)
            text, reason = text[:position], "stop"
        out.append(Completion(text, beam.tokens, beam.logprobs, reason, prompt_index, j, stop))
    return out
