"""Log-likelihood scoring: how probable a model finds a continuation after a context, for every model family.

The two questions EleutherAI's lm-evaluation-harness asks a language model, answered from token ids, so that
`tinylm eval --task` (multiple choice, `tinylm.task_eval`) and the harness's adapter (`tinylm.harness`) share
one implementation:

- `loglikelihoods(model, [(context, continuation), ...])`: for each pair, the summed natural-log probability
  of the continuation's tokens, each given everything before it, and whether greedy decoding would have written
  exactly them (the harness's ``is_greedy``). Multiple-choice accuracy picks the choice with the largest sum.
- `rolling_loglikelihood(model, tokens)`: a whole text's log-likelihood, read in disjoint windows of the
  model's block_size exactly as `tinylm eval` reads a text (`tinylm.evaluate`), so -ll / (bytes ln 2) is the
  bits per byte `tinylm eval` prints.
- `encode_pair(tokenizer, context, continuation, start_ids)`: the (context ids, continuation ids) of a text pair,
  split as the harness's ``_encode_pair`` splits them.

``model`` is any family: a `GPT`, a `RecurrentLM` (LSTM or RNN), or an `NGramLM` (an n-gram model behind the
same interface; `tinylm.run.load_run` gives each). Usage::

    run = load_run("runs/tiny-shakespeare")
    pair = encode_pair(run.tokenizer, "ROMEO: Good", " morrow", run.start_ids)   # (context ids, continuation ids)
    [(ll, greedy)] = loglikelihoods(run.model, [pair])
    ll_text = rolling_loglikelihood(run.model, [run.tokenizer.eos_id] + run.tokenizer.encode(text))

How each family is scored:

- a network (Transformer, LSTM, RNN) reads ``context + continuation[:-1]`` as one row; the logits at the
  continuation's positions give its log-probabilities. A pair longer than the model's context keeps its last
  block_size + 1 tokens (the harness's rule: the last token is only predicted), so the context is cut from the
  left. Rows are sorted longest first and batched (few padding tokens; right padding is never read by the
  positions scored, as attention and recurrence are causal). A Transformer reads each distinct context once
  instead, and every continuation of it after it from a KV cache (``share_context``): the choices of a
  multiple-choice question share their context, often a long few-shot prompt.
- an n-gram model scores the pairs in one vectorised pass (`NGramModel.score`), each pair a document of its own
  (the context restarts after EOS, as in counting and in `tinylm eval`); its context is its last n - 1 tokens,
  so nothing is cut. ``is_greedy`` compares each continuation token with the argmax of
  `NGramModel.next_token_distribution`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import torch
from torch import Tensor, nn

from tinylm.errors import TinyLMError
from tinylm.evaluate import EVAL_BATCH_TOKENS, EvalText, _eval_mode, evaluate_model
from tinylm.generate.cache import KVCache
from tinylm.model import GPT, NGramLM

Request = tuple[Sequence[int], Sequence[int]]  # (context ids, continuation ids)


def encode_pair(tokenizer, context: str, continuation: str, start_ids: Sequence[int] = ()
                ) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) of a text pair, as lm-evaluation-harness's ``_encode_pair`` makes them.

    The context's trailing whitespace moves to the front of the continuation (a BPE tokenizer joins a space to
    the word after it); then the context and the whole are encoded, each after ``start_ids`` (a run's
    `start_ids`: what a text is read after), and the continuation is what the whole has beyond the context's
    length, so the pair's ids are those of the text as a model reads it whole. An empty context is the last
    start id (EOS where there are none) alone, as the harness gives its prefix token.
    """
    start = list(start_ids)
    if not context:
        prefix = start[-1] if start else tokenizer.eos_id
        ids = tokenizer.encode(continuation)
        return ([prefix], ids) if ids[:1] != [prefix] else (ids[:1], ids[1:])
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    context_ids = start + tokenizer.encode(context)
    whole = start + tokenizer.encode(context + continuation)
    return context_ids, whole[len(context_ids):]


def loglikelihoods(model: nn.Module, requests: Sequence[Request], *, batch_size: int | None = None,
                   share_context: bool | None = None) -> list[tuple[float, bool]]:
    """(log p(continuation | context), whether the continuation is the greedy one) for each request, in order.

    ``requests`` are (context ids, continuation ids) pairs; the context must hold at least one token (the
    start token when there is no text before: a run's `start_ids`). An empty continuation scores (0.0, True).
    ``batch_size``: rows per forward pass of a network; None packs about `EVAL_BATCH_TOKENS` tokens a pass, as
    `tinylm eval` does. ``share_context``: read each distinct context once and its continuations after it from a
    KV cache (a Transformer only; None: for a Transformer, which is faster, `benchmarks/task_speed.py`), or read
    every pair whole (False). See the module docstring for how each family scores and how long pairs are cut.
    """
    pairs = [(list(map(int, c)), list(map(int, x))) for c, x in requests]
    for context, _ in pairs:
        if not context:
            raise TinyLMError("a loglikelihood request has an empty context: give at least the token the "
                              "continuation follows (a run's start token, EOS for tinylm's tokenizers)")
    if batch_size is not None and batch_size < 1:
        raise TinyLMError(f"batch_size must be positive, got {batch_size}")
    share = isinstance(model, GPT) if share_context is None else share_context
    if share and not isinstance(model, GPT):
        raise TinyLMError("share_context reads each context into a Transformer's KV cache; this model is not one")
    out: list[tuple[float, bool]] = [(0.0, True)] * len(pairs)
    todo = [i for i, (_, continuation) in enumerate(pairs) if continuation]
    if not todo:
        return out
    if isinstance(model, NGramLM):
        scored = _ngram_loglikelihoods(model, [pairs[i] for i in todo])
    elif share:
        scored = _shared_context_loglikelihoods(model, [pairs[i] for i in todo], batch_size)
    else:
        scored = _network_loglikelihoods(model, [pairs[i] for i in todo], batch_size)
    for i, result in zip(todo, scored):
        out[i] = result
    return out


def rolling_loglikelihood(model: nn.Module, tokens: Sequence[int], *, batch_size: int | None = None) -> float:
    """The summed natural-log probability of a whole text: ``tokens[0]`` is the token it is read after (EOS for
    tinylm's tokenizers, a run's last `start_ids`: BOS for an imported Llama), only read; every later token is
    scored once.

    A network reads the text in disjoint windows of its block_size, each window from a fresh start (a
    Transformer's attention, an RNN's zero state), the first after ``tokens[0]``: the windows and the sums are
    `tinylm.evaluate.evaluate_model`'s, so the result is minus the loss sum `tinylm eval` reports for the same
    ids. An n-gram model scores the text in one piece, its context restarting after each EOS.
    """
    if len(tokens) < 2:
        return 0.0
    text = EvalText("text", np.asarray(tokens[1:], dtype=np.int64), 1)  # the byte count plays no part here
    result = evaluate_model(model, text, None, block_size=model.config.block_size, batch_size=batch_size,
                            device=str(_device(model)), start_id=int(tokens[0]))
    return -result.loss_sum


# ----- networks: Transformer, LSTM, RNN ------------------------------------------------------------------------


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def _logits(model: nn.Module, x: Tensor, **kwargs) -> Tensor:
    out = model(x, **kwargs)
    return out[0] if isinstance(out, tuple) else out  # (B, T, |V|)


def _fit(context: list[int], continuation: list[int], block_size: int) -> list[int]:
    """The row a network reads for one pair: context + continuation[:-1], cut from the left to block_size."""
    if len(continuation) > block_size:
        raise TinyLMError(f"a continuation of {len(continuation)} tokens does not fit the model's context of "
                          f"{block_size} tokens; score shorter continuations")
    return (context + continuation)[-(block_size + 1):-1]


def _batches(order: list[int], lengths: list[int], batch_size: int | None) -> Iterator[list[int]]:
    """Runs of ``order`` (rows sorted longest first): ``batch_size`` rows each, or about `EVAL_BATCH_TOKENS`
    padded tokens (at least one row) when it is None."""
    start = 0
    while start < len(order):
        if batch_size is not None:
            size = batch_size
        else:
            size = max(1, EVAL_BATCH_TOKENS // max(1, lengths[order[start]]))
        yield order[start:start + size]
        start += size


@torch.inference_mode()
def _network_loglikelihoods(model: nn.Module, pairs: list[tuple[list[int], list[int]]], batch_size: int | None
                            ) -> list[tuple[float, bool]]:
    block_size = model.config.block_size
    device = _device(model)
    rows = [_fit(context, continuation, block_size) for context, continuation in pairs]
    lengths = [len(r) for r in rows]
    order = sorted(range(len(rows)), key=lambda i: -lengths[i])  # longest first: little padding
    out: list[tuple[float, bool]] = [(0.0, False)] * len(rows)
    with _eval_mode(model):
        for batch in _batches(order, lengths, batch_size):
            width = lengths[batch[0]]
            x = torch.zeros(len(batch), width, dtype=torch.long)  # right padding: read after every scored position
            for b, i in enumerate(batch):
                x[b, :lengths[i]] = torch.tensor(rows[i])
            logits = _logits(model, x.to(device))  # (B, T, |V|)
            # the positions that predict a continuation token: the last len(continuation) of each row
            row_ix, pos_ix, targets, owner = [], [], [], []
            for b, i in enumerate(batch):
                continuation = pairs[i][1]
                n = len(continuation)
                row_ix += [b] * n
                pos_ix += range(lengths[i] - n, lengths[i])
                targets += continuation
                owner += [i] * n
            picked = logits[torch.tensor(row_ix, device=device), torch.tensor(pos_ix, device=device)].float()
            _collect(picked, targets, owner, out)  # (N, |V|)
    return out


@torch.inference_mode()
def _shared_context_loglikelihoods(model: nn.Module, pairs: list[tuple[list[int], list[int]]],
                                   batch_size: int | None) -> list[tuple[float, bool]]:
    """The Transformer's scores, each distinct context read once: a batch of contexts (left-padded, hidden by the
    attention mask, as the generation engine pads prompts) fills a KV cache, whose last logits predict every
    continuation's first token; the cache's rows are then repeated for each continuation of their context, and
    the continuations (right-padded) are read after them. Pairs that must be cut to fit the window are read whole
    (`_network_loglikelihoods`)."""
    block_size = model.config.block_size
    device = _device(model)
    out: list[tuple[float, bool]] = [(0.0, False)] * len(pairs)
    groups: dict[tuple[int, ...], list[int]] = {}
    cut = []
    for i, (context, continuation) in enumerate(pairs):
        if len(context) + len(continuation) - 1 > block_size:
            cut.append(i)
        else:
            groups.setdefault(tuple(context), []).append(i)
    if cut:
        for i, result in zip(cut, _network_loglikelihoods(model, [pairs[i] for i in cut], batch_size)):
            out[i] = result
    # longest context first; a batch of contexts shares one cache, so its longest context and longest
    # continuation must fit the window together
    contexts = sorted(groups, key=len, reverse=True)
    with _eval_mode(model):
        start = 0
        while start < len(contexts):
            width = len(contexts[start])
            budget = batch_size or max(1, EVAL_BATCH_TOKENS // width)
            batch, longest = [], 0
            for context in contexts[start:start + budget]:
                tail = max(len(pairs[i][1]) for i in groups[context]) - 1
                if width + max(longest, tail) > block_size:
                    break
                batch.append(context)
                longest = max(longest, tail)
            start += len(batch)
            _score_shared(model, pairs, [(c, groups[c]) for c in batch], width, device, out, batch_size)
    return out


def _score_shared(model: nn.Module, pairs: list[tuple[list[int], list[int]]],
                  batch: list[tuple[tuple[int, ...], list[int]]], width: int, device: torch.device,
                  out: list[tuple[float, bool]], batch_size: int | None) -> None:
    """One batch of `_shared_context_loglikelihoods`: contexts (each with the pairs that continue it) of up to
    ``width`` tokens. The continuations are read in passes of similar lengths (few padding tokens), each from the
    cache rows of their contexts (`KVCache.merged`)."""
    G = len(batch)
    x = torch.zeros(G, width, dtype=torch.long)
    mask = torch.zeros(G, width, dtype=torch.bool)
    for g, (context, _) in enumerate(batch):
        x[g, width - len(context):] = torch.tensor(context)
        mask[g, width - len(context):] = True
    x, mask = x.to(device), mask.to(device)
    cache = KVCache.for_model(model, G, width)
    last = _logits(model, x, attention_mask=mask, kv_cache=cache)[:, -1]  # (G, |V|): each context's prediction of what follows
    members = [(g, i) for g, (_, group) in enumerate(batch) for i in group]
    picked = [last[torch.tensor([g for g, _ in members], device=device)]]  # (M, |V|)
    targets, owner = [pairs[i][1][0] for _, i in members], [i for _, i in members]
    # the rest of each continuation, read after its context: longest first, about EVAL_BATCH_TOKENS a pass
    longer = sorted(((g, i) for g, i in members if len(pairs[i][1]) > 1), key=lambda m: -len(pairs[m[1]][1]))
    start = 0
    while start < len(longer):
        tail = len(pairs[longer[start][1]][1]) - 1
        chunk = longer[start:start + (batch_size or max(1, EVAL_BATCH_TOKENS // (width + tail)))]
        start += len(chunk)
        rows = torch.tensor([g for g, _ in chunk], device=device)
        y = torch.zeros(len(chunk), tail, dtype=torch.long)
        for r, (_, i) in enumerate(chunk):
            rest = pairs[i][1][:-1]
            y[r, :len(rest)] = torch.tensor(rest)
        keys = torch.cat([mask[rows], torch.ones(len(chunk), tail, dtype=torch.bool, device=device)], dim=1)
        logits = _logits(model, y.to(device), attention_mask=keys,
                         kv_cache=KVCache.merged([(cache, rows)], width, width + tail))  # (B', tail, |V|)
        row_ix, pos_ix = [], []
        for r, (_, i) in enumerate(chunk):
            rest = pairs[i][1][1:]
            row_ix += [r] * len(rest)
            pos_ix += range(len(rest))
            targets += rest
            owner += [i] * len(rest)
        picked.append(logits[torch.tensor(row_ix, device=device), torch.tensor(pos_ix, device=device)])
    _collect(torch.cat(picked).float(), targets, owner, out)


def _collect(picked: Tensor, targets: list[int], owner: list[int], out: list[tuple[float, bool]]) -> None:
    """Sum the log-probabilities of ``targets`` under the logits ``picked`` (N, |V|) into each owner's entry of
    ``out``, and whether every one of them was the argmax."""
    logp = torch.log_softmax(picked, dim=-1)  # (N, |V|)
    target = torch.tensor(targets, device=picked.device)
    lp = logp.gather(1, target[:, None])[:, 0].double().cpu().tolist()  # (N,)
    hit = (logp.argmax(dim=-1) == target).cpu().tolist()  # (N,)
    sums: dict[int, list] = {}
    for i, value, greedy in zip(owner, lp, hit):
        entry = sums.setdefault(i, [0.0, True])
        entry[0] += value
        entry[1] = entry[1] and greedy
    for i, (value, greedy) in sums.items():
        out[i] = (value, greedy)


# ----- n-gram models -------------------------------------------------------------------------------------------


def _ngram_loglikelihoods(model: NGramLM, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
    ngram = model.ngram
    eos = ngram.eos_id
    # every pair a document of its own: EOS after it, so the next pair's context starts afresh
    stream, starts = [], []
    for context, continuation in pairs:
        starts.append(len(stream) + len(context))
        stream += context + continuation + [eos]
    logp = ngram.score(np.asarray(stream, dtype=np.int64))  # (len(stream),) natural log
    argmax: dict[tuple[int, ...], int] = {}  # the greedy next token after each n - 1 tokens of context

    def greedy(history: list[int]) -> int:
        if eos in history:  # the document restarts after EOS, as the model reads it
            history = history[len(history) - history[::-1].index(eos):]
        key = tuple(history[-(ngram.order - 1):]) if ngram.order > 1 else ()
        key = key if len(key) == ngram.order - 1 else ("start", *key)
        if key not in argmax:
            argmax[key] = int(np.argmax(ngram.next_token_distribution(history)))
        return argmax[key]

    out = []
    for (context, continuation), start in zip(pairs, starts):
        value = float(logp[start:start + len(continuation)].sum())
        whole = context + continuation
        is_greedy = all(greedy(whole[:len(context) + k]) == token for k, token in enumerate(continuation))
        out.append((value, is_greedy))
    return out
