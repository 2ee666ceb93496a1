"""The pieces every generator here is built from: the engine, beam search, the reference generator
and the server's scheduler all use them, so they sit below all four.

- `Completion`: one generated sample, what every generator returns.
- the model calls: `prefill` (the whole window, filling the KV cache) and `decode_one_token` (the new
  tokens only, against the cache); `left_pad` lines up prompts of different lengths for a batch.
- the context-window rule: `context_start` (where the window begins at each length), `window_keep`
  and `warn_window` (the engine's module docstring explains the policy); `fit_prompt` and
  `keep_prompt`, the one rule for a prompt longer than the model reads (every command follows it).
- the stopping rule for one new token: `accept_token`.
"""

from __future__ import annotations

import warnings
from collections.abc import Container, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import torch
from torch import Tensor, nn

from tinylm.errors import TinyLMError
from tinylm.generate.cache import KVCache, cache_for, merge_rows
from tinylm.generate.sampling import SamplingParams
from tinylm.generate.stream import TextStream

FinishReason = Literal["stop", "length"]


@dataclass
class Completion:
    """One generated sample.

    ``text`` the new text (without the prompt, cut before a stop string, without the stop
    token's text); ``token_ids`` the new tokens; ``logprobs`` the model's log-probability of each
    of them (temperature 1, no filters); ``finish_reason`` "stop" or "length"; ``stop`` the stop
    id or string that ended it (None for "length"); ``prompt_index`` and ``sample_index`` say
    which prompt and which of its ``num_samples`` samples this is.
    """

    text: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    prompt_index: int = 0
    sample_index: int = 0
    stop: int | str | None = None


# ----- the model calls, the window, the stopping rule ------------------------------------------


def prefill(model: nn.Module, idx: Tensor, cache: KVCache, attention_mask: Tensor | None = None,
            position_ids: Tensor | None = None) -> Tensor:
    """Run the prompts idx (B, T) through the model, filling the cache; the last position's logits (B, V)."""
    logits, _ = model(idx, attention_mask=attention_mask, position_ids=position_ids, kv_cache=cache)
    return logits[:, -1]  # (B, V)


def decode_one_token(model: nn.Module, tokens: Tensor, cache: KVCache, attention_mask: Tensor | None = None,
                     position_ids: Tensor | None = None) -> Tensor:
    """One step: the new tokens (B,) in, their keys and values appended to the cache, next logits (B, V) out."""
    logits, _ = model(tokens[:, None], attention_mask=attention_mask, position_ids=position_ids, kv_cache=cache)
    return logits[:, -1]  # (B, V)


def real_positions(mask: Tensor) -> Tensor:
    """Each token's position from a left-padded mask (B, T): real tokens count from 0; padding sits at 0 (it is masked)."""
    return (mask.long().cumsum(dim=1) - 1).clamp(min=0)  # (B, T)


class Decoder(Protocol):
    """A batch of rows being decoded: what the engine, speculative decoding and the server drive.

    Every row's cached tokens end in column ``length - 1`` (right-aligned; shorter rows padded on
    the left and hidden by ``mask``); ``next_position`` (B, 1) is the position each row's next
    token takes (rows count their own tokens). `tinylm.generate.fast.StaticDecoder` implements it
    for a GPT, `CachedDecoder` for every family.

    - ``start(idx, mask, every=False)``: forget everything, read left-padded windows idx (B, T);
      the last position's logits (B, V), or every position's (B, T, V) with ``every``;
    - ``step(tokens)``: one new token (B,) per row; the next logits (B, V);
    - ``extend(tokens, pad_to=None)``: several new tokens (B, T) per row; their logits (B, T, V);
    - ``truncate(length, last_token=None)``: forget the columns from ``length`` on (a rejected draft);
    - ``reorder(rows)``: row b becomes old row rows[b] (keeping some rows shrinks the batch);
    - ``merged(parts, width, capacity)`` (class method): the kept rows (decoder, rows) of several
      decoders as one, right-aligned at column ``width``, with room up to ``capacity``.
    """

    length: int
    mask: Tensor  # (B, capacity): True at the columns holding real tokens
    next_position: Tensor  # (B, 1)

    @property
    def max_len(self) -> int: ...

    def start(self, idx: Tensor, mask: Tensor, every: bool = False) -> Tensor: ...

    def step(self, tokens: Tensor) -> Tensor: ...

    def extend(self, tokens: Tensor, pad_to: int | None = None) -> Tensor: ...

    def truncate(self, length: int, last_token: int | None = None) -> None: ...

    def reorder(self, rows: Tensor) -> None: ...

    def reset(self) -> None: ...


class CachedDecoder:
    """The `Decoder` through the model's own forward and cache (`cache_for`): every family.

    `tinylm.generate.fast.StaticDecoder` does the same for a GPT, faster. Only a `KVCache` (a
    Transformer's) can be truncated or merged; an RNN's state or an n-gram's history can only
    be reordered.
    """

    def __init__(self, model: nn.Module, batch: int, capacity: int) -> None:
        self.model = model
        self.cache = cache_for(model, batch, capacity)
        self.mask = torch.zeros(batch, capacity, dtype=torch.bool, device=next(model.parameters()).device)
        self.reset()

    @property
    def max_len(self) -> int:
        return self.cache.max_len

    def _look_for_padding(self) -> None:
        # whether any filled column is padding (else attention needs no mask); only start, merging and
        # reordering change it (new columns are real tokens)
        self.padded = not bool(self.mask[:, :self.length].all())

    def reset(self) -> None:
        self.cache.reset()
        self.mask.zero_()
        self.length = 0
        self.padded = False
        self.next_position = torch.zeros(self.mask.size(0), 1, dtype=torch.long, device=self.mask.device)

    def start(self, idx: Tensor, mask: Tensor, every: bool = False) -> Tensor:
        self.reset()
        T = idx.size(1)
        self.mask[:, :T] = mask
        self.length = T
        self._look_for_padding()
        position_ids = real_positions(mask)  # (B, T)
        self.next_position = position_ids[:, -1:] + 1  # (B, 1): where each row's next token goes
        logits, _ = self.model(idx, attention_mask=mask if self.padded else None, position_ids=position_ids,
                               kv_cache=self.cache)  # (B, T, V)
        return logits if every else logits[:, -1]

    def extend(self, tokens: Tensor, pad_to: int | None = None) -> Tensor:
        """Append ``tokens`` (B, T) after what is cached; their logits (B, T, V).
        (``pad_to`` is `StaticDecoder.extend`'s, for a compiled graph; nothing is compiled here.)"""
        T = tokens.size(1)
        self.mask[:, self.length:self.length + T] = True
        self.length += T
        positions = self.next_position + torch.arange(T, device=tokens.device)  # (B, T)
        self.next_position = self.next_position + T
        attention_mask = self.mask[:, :self.length] if self.padded else None
        logits, _ = self.model(tokens, attention_mask=attention_mask, position_ids=positions, kv_cache=self.cache)
        return logits

    def step(self, tokens: Tensor) -> Tensor:
        return self.extend(tokens[:, None])[:, -1]

    def truncate(self, length: int, last_token: int | None = None) -> None:
        """Forget the positions from ``length`` on (a rejected draft); ``last_token`` is the token now last
        (one row; a bigram-hash model needs it)."""
        if not isinstance(self.cache, KVCache):
            raise TinyLMError("this model keeps a state that cannot be rolled back (not a KV cache)")
        last = torch.tensor([last_token], device=self.mask.device) if last_token is not None else None
        self.cache.truncate(length, last_tokens=last)
        self.mask[:, length:self.length] = False
        self.next_position = self.next_position - (self.length - length)
        self.length = length

    def reorder(self, rows: Tensor) -> None:
        self.cache.reorder(rows)
        self.mask = self.mask[rows]
        self.next_position = self.next_position[rows]
        self._look_for_padding()

    @classmethod
    def merged(cls, parts: Sequence[tuple[CachedDecoder, Tensor]], width: int, capacity: int) -> CachedDecoder:
        first = parts[0][0]
        decoder = cls.__new__(cls)
        decoder.model = first.model
        decoder.cache = KVCache.merged([(d.cache, rows) for d, rows in parts], width, capacity)
        decoder.mask = merge_rows([(d.mask[..., None], rows, d.length) for d, rows in parts], width, capacity)[..., 0]
        decoder.next_position = torch.cat([d.next_position[rows] for d, rows in parts])
        decoder.length = width
        decoder._look_for_padding()
        return decoder


def context_start(n: int, block_size: int, keep: int) -> int:
    """Where the model's window starts in a sequence of ``n`` tokens (the window is tokens[start:n]).

    Up to ``block_size`` tokens, the whole sequence. Beyond, the window was cut to the last
    ``keep`` tokens when it overflowed, and has grown by one per token since, until full again
    (``block_size - keep + 1`` lengths per cycle: keep, keep + 1, ..., block_size).
    """
    if not 1 <= keep <= block_size:
        raise TinyLMError(f"window_keep must be between 1 and block_size ({block_size}), got {keep}")
    if n <= block_size:
        return 0
    grown = (n - block_size - 1) % (block_size - keep + 1)  # tokens added since the last cut
    return n - keep - grown


def window_keep(params: SamplingParams, block_size: int) -> int:
    """The number of tokens the window policy keeps: ``params.window_keep`` or half the context."""
    keep = params.window_keep if params.window_keep is not None else max(1, block_size // 2)
    if keep > block_size:
        raise TinyLMError(f"window_keep ({keep}) cannot exceed the model's context (block_size = {block_size})")
    return keep


def fit_prompt(ids: Sequence[int], block_size: int, room: int = 0) -> tuple[list[int], str | None]:
    """A prompt as the model reads it: its last ``block_size - room`` tokens, and the warning line when that
    dropped some (None when the whole prompt fits).

    The one policy for a prompt longer than the context, in `tinylm sample`, `tinylm next-token`,
    `tinylm explain` and the server: the most recent text is what a continuation depends on, so it is
    kept and the start is dropped, never refused. ``room`` is the positions to leave free for new tokens:
    0 where generation slides its window as it goes (`generate`), ``max_tokens`` in the server, whose
    batches never slide. Only a ``room`` that leaves nothing to keep is refused (`TinyLMError`).
    """
    limit = block_size - room
    if limit < 1:
        raise TinyLMError(f"{room} new tokens leave no room for a prompt in the model's context of {block_size} "
                          f"tokens: ask for fewer than {block_size}")
    ids = list(ids)
    if len(ids) <= limit:
        return ids, None
    where = (f"the model's context of {block_size}" if not room else
             f"the {limit} the model's context of {block_size} holds beside {room} new tokens")
    return ids[-limit:], (f"the prompt is {len(ids)} tokens, longer than {where}: keeping its last {limit} tokens "
                          f"(the first {len(ids) - limit} are not read)")


def keep_prompt(ids: Sequence[int], block_size: int, room: int = 0) -> list[int]:
    """`fit_prompt`'s tokens, its warning given with `warnings.warn` (the CLI prints it as one line)."""
    kept, warning = fit_prompt(ids, block_size, room)
    if warning is not None:
        warnings.warn(warning, stacklevel=3)
    return kept


def warn_window(block_size: int, keep: int) -> None:
    warnings.warn(
        f"prompt plus generation exceed the model's context of {block_size} tokens: keeping the most recent "
        f"{keep} tokens and reading them afresh (older text is no longer seen)",
        stacklevel=3,
    )


def accept_token(stream: TextStream | None, token: int, stop_ids: Container[int],
                 last_step: bool) -> tuple[str, FinishReason | None, int | str | None]:
    """The stopping rule (module docstring), for one new token of one sample: (text released, finish reason, stop).

    A stop id ends the sample and its own text is never shown; a stop string ends it with the text
    cut before it; the last allowed token ends it with "length" and releases whatever the stream
    held back. Otherwise the finish reason is None. The engine and the server both decide by it.
    """
    if token in stop_ids:
        return (stream.finish() if stream else ""), "stop", token
    piece = stream.push(token) if stream else ""
    if stream is not None and stream.stopped_by is not None:
        return piece, "stop", stream.stopped_by
    if last_step:
        return piece + (stream.finish() if stream else ""), "length", None
    return piece, None, None


def left_pad(windows: Sequence[Sequence[int]], device: torch.device | str = "cpu") -> tuple[Tensor, Tensor]:
    """Token lists of different lengths -> ids (B, T) padded on the left with 0, and the mask (B, T), False at padding.

    The padding id does not matter (the mask hides it); 0 is a valid id for every vocabulary.
    """
    T = max(len(w) for w in windows)
    idx = torch.zeros(len(windows), T, dtype=torch.long)
    mask = torch.zeros(len(windows), T, dtype=torch.bool)
    for b, w in enumerate(windows):
        if w:
            idx[b, T - len(w):] = torch.tensor(w, dtype=torch.long)
            mask[b, T - len(w):] = True
    return idx.to(device), mask.to(device)
