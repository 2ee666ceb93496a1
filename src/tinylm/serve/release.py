"""What the scheduler sends for a row's new token: the text that became certain and the tokens listed with it.

**Text and logprobs in step.** A row's text is released by its `TextStream` (whole characters,
nothing that may still turn into a stop string), and its tokens' log-probabilities are released
with it: an event lists the tokens whose text *begins* in the text released so far. A token
whose bytes are only part of a character waits for that character. When a stop string ends the
row, the tokens that begin at or after the cut (the ones that only make up the stop string) are
never listed; a token straddling the cut (its text begins before it) is listed whole. A stop
token (end of text) is never listed either. So logprobs cover exactly the returned text, streamed
or not; every drawn token still counts as generated (`ChoiceEvent.generated`, the usage).
"""

from __future__ import annotations

import torch
from torch import Tensor

from tinylm.generate.steps import accept_token
from tinylm.serve.batch import Row
from tinylm.serve.jobs import ChoiceEvent, PromptEvent, TokenLogprob
from tinylm.tokenizers.base import Tokenizer


def drawn(row: Row, token: int, logprob: float, top: tuple[tuple[int, float], ...]) -> TokenLogprob:
    """A token just drawn for ``row``, at the offset of the characters decoded before it."""
    return TokenLogprob(token, logprob, len(row.stream.text) + len(row.stream.pending), top)


def accept(row: Row, info: TokenLogprob) -> ChoiceEvent:
    """Append a row's token; decide whether the row is done; the text and the tokens it releases.

    The rule is the generation engine's (`accept_token`): a stop id ends the row and its text
    is never shown; a stop string ends it with the text cut before it; the last allowed token
    ends it with finish reason "length" and releases whatever was held back. The tokens go out
    with their text (`release`).
    """
    row.seq.append(info.id)
    stop_ids = row.job.request.stop_ids
    stop_token = info.id in stop_ids
    if not stop_token:  # a stop token is never listed: its text is never shown
        row.held.append(info)
    piece, row.finish_reason, _ = accept_token(row.stream, info.id, stop_ids, row.remaining == 0)
    # a stop string keeps back the tokens that only make it up; a stop token or the length releases all
    everything = stop_token or row.finish_reason == "length"
    return ChoiceEvent(row.index, piece, release(row, everything=everything), 1, row.finish_reason)


def release(row: Row, everything: bool) -> tuple[TokenLogprob, ...]:
    """The held tokens whose text begins in the row's released text (all of them when the whole text was
    released); once the row is done, the rest are dropped (they only make up a stop string)."""
    if everything:
        released, row.held = row.held, []
    else:
        shown = len(row.stream.text)
        k = 0
        while k < len(row.held) and row.held[k].offset < shown:  # offsets never decrease
            k += 1
        released, row.held = row.held[:k], row.held[k:]
    if row.finish_reason is not None:
        row.held = []
    return tuple(released)


def top_logprobs(rows: list[Row], logits: Tensor, vocab_size: int) -> dict[int, tuple[tuple[int, float], ...]]:
    """For rows that asked for alternatives: the k most likely tokens and their log-probabilities."""
    asking = [b for b, r in enumerate(rows) if r.job.logprobs]
    if not asking:
        return {}
    k = min(max(rows[b].job.logprobs for b in asking), vocab_size)
    logp = torch.log_softmax(logits[asking], dim=-1)  # (b, V)
    values, ids = logp.topk(k, dim=-1)  # (b, k) each
    # the ids no sample takes (-inf) are no alternatives: a row lists fewer when fewer can be drawn
    return {b: tuple((t, v) for t, v in zip(ids[i, :rows[b].job.logprobs].tolist(),
                                            values[i, :rows[b].job.logprobs].tolist()) if v > float("-inf"))
            for i, b in enumerate(asking)}


def prompt_logprobs(row: Row, logits: Tensor, tokenizer: Tokenizer) -> PromptEvent:
    """log p of each prompt token from ``echo_from`` on, from the prefill's logits (prompt_len, V) of its row.

    Token j is predicted by the logits at j - 1; the very first token of a sequence has no
    prediction (None), which only happens when no start ids come before the prompt.
    """
    job = row.job
    prompt = row.seq[:row.prompt_len]
    logp = torch.log_softmax(logits[:row.prompt_len - 1].float(), dim=-1)  # (prompt_len - 1, V)
    targets = torch.tensor(prompt[1:], dtype=torch.long, device=logp.device)  # (prompt_len - 1,)
    chosen = logp.gather(-1, targets[:, None])[:, 0].tolist()
    k = job.logprobs or 0
    values, ids = logp.topk(min(k, logp.size(-1)), dim=-1)  # (prompt_len - 1, k) each
    decoder = tokenizer.stream_decoder()
    offset, tokens = 0, []
    for j in range(job.echo_from, row.prompt_len):
        if j == 0:
            tokens.append(TokenLogprob(prompt[0], None, offset))
        else:
            tokens.append(TokenLogprob(prompt[j], chosen[j - 1], offset,
                                       tuple(zip(ids[j - 1].tolist(), values[j - 1].tolist()))))
        offset += len(decoder.push(prompt[j]))
    return PromptEvent(row.index // job.n, tuple(tokens))
