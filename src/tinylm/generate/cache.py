"""The KV cache: the keys and values of every position seen so far, kept so each step computes only the new one.

In a causal Transformer the keys and values of position t depend only on tokens <= t, so once
computed they never change. Generating n tokens by recomputing the whole sequence every step
costs O(n) forward passes of growing length; with a cache, step t runs the model on the one new
token, appends its keys and values (per layer) to the stored ones, and attends over all of them.

The buffers here are *static*: allocated once, at their final size (batch, kv heads,
``max_len``, head size), and filled in place, as in gpt-fast. Nothing is reallocated or
concatenated while generating, and the memory needed is known up front:

    bytes = 2 (K and V) x n_layer x batch x n_kv_head x max_len x head_dim x bytes per number

With grouped-query attention only the n_kv_head key/value heads are stored (a GQA model with
n_kv_head = n_head / 4 needs a quarter of the cache of its multi-head twin); the model repeats
them for its query heads when it attends.

`KVCache` is a sequence of `StaticKVCacheLayer`, one per block, which is what `GPT.forward`
takes as ``kv_cache`` (each layer implements `tinylm.model.attention.KVCacheLayer`).

    cache = KVCache.for_model(model, batch=1, max_len=128)
    logits, _ = model(prompt, kv_cache=cache)          # prefill: stores the prompt's keys/values
    logits, _ = model(next_token, kv_cache=cache)      # one step: the new token only

A model that remembers the past in another form (an RNN's state, an n-gram's last tokens) makes
its own cache with a ``new_cache(batch, max_len)`` method; `cache_for` asks for it, so the
engine and beam search drive every model family the same way.

Batches whose rows come and go (the server's) keep their rows *right-aligned*: every row's last
cached token in the same column, shorter rows padded on the left and hidden by a mask.
`merge_rows` joins the kept rows of several such buffers into one, trimmed to the columns
they need; ``reorder`` keeps some rows (shrinking) or repeats them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch import Tensor, nn

from tinylm.errors import TinyLMError
from tinylm.model.cursor import CacheCursor


class StaticKVCacheLayer(CacheCursor):
    """One layer's keys and values, (B, n_kv, max_len, hs) each, filled from the left; ``length`` stored."""

    def __init__(self, batch: int, n_kv_head: int, max_len: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        super().__init__(max_len)
        self.k = torch.zeros(batch, n_kv_head, max_len, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros(batch, n_kv_head, max_len, head_dim, dtype=dtype, device=device)

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store the new keys and values (B, n_kv, T_new, hs); return all stored ones (B, n_kv, T_k, hs)."""
        start, end = self.length, self.length + k.size(2)
        if end > self.max_len:
            raise TinyLMError(f"the KV cache holds {self.max_len} positions; {end} do not fit "
                              "(allocate a larger cache or start a new window)")
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        self._advance(end - start)
        # views of the filled part, no copy: (B, n_kv, end, hs)
        return self.k[:, :, :end], self.v[:, :, :end]

    def reorder(self, rows: Tensor) -> None:
        """Row b becomes old row rows[b] (beam search keeps the beams it extends; samples share a prompt)."""
        self.k = self.k.index_select(0, rows)
        self.v = self.v.index_select(0, rows)

    def reset(self) -> None:
        """Forget everything (the buffers are kept and overwritten)."""
        self._rewind()

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` positions and forget the rest (speculative decoding rolls back rejected
        drafts): the stale entries past ``length`` are never read again, only overwritten."""
        if not 0 <= length <= self.length:
            raise TinyLMError(f"cannot truncate a cache of {self.length} positions to {length}")
        self._rewind()
        self._advance(length)


def merge_rows(parts: Sequence[tuple[Tensor, Tensor, int]], width: int, capacity: int) -> Tensor:
    """The kept rows of several right-aligned buffers as one buffer, right-aligned at column ``width``.

    Each part is (buffer (B_i, ..., S_i, X), rows to keep (b_i,), columns filled n_i). A kept row
    brings its last min(n_i, width) columns, placed just before column ``width``; the columns on
    their left (padding) and from ``width`` to ``capacity`` (room to grow) are zeros (False for a
    mask). Returns (sum of b_i, ..., capacity, X). A row loses nothing as long as its tokens are at
    most ``width`` (the caller takes ``width`` as the longest row's).
    """
    first = parts[0][0]
    total = sum(len(rows) for _, rows, _ in parts)
    out = first.new_zeros((total, *first.shape[1:-2], capacity, first.size(-1)))
    start = 0
    for buffer, rows, filled in parts:
        taken = min(filled, width)
        out[start:start + len(rows), ..., width - taken:width, :] = buffer[rows][..., filled - taken:filled, :]
        start += len(rows)
    return out


def cache_for(model: nn.Module, batch: int, max_len: int):
    """The generation cache for ``model``: its own (``model.new_cache``) or a `KVCache`."""
    make = getattr(model, "new_cache", None)
    if make is not None:
        return make(batch, max_len)
    return KVCache.for_model(model, batch, max_len)


class KVCache(Sequence[StaticKVCacheLayer]):
    """One `StaticKVCacheLayer` per block of the model, all of the same shape."""

    def __init__(self, layers: Sequence[StaticKVCacheLayer]) -> None:
        self.layers = list(layers)
        # each row's last token read (B,), kept by a model with a bigram-hash embedding (`GPT.bigram_ids`):
        # the next token's pair starts with it
        self.last_tokens: Tensor | None = None

    @classmethod
    def for_model(cls, model: nn.Module, batch: int, max_len: int) -> KVCache:
        """A cache for ``batch`` sequences of up to ``max_len`` positions, in the model's dtype and device.

        ``model.config`` gives n_layer, the number of key/value heads and the head size (a
        `GPTConfig`).
        """
        cfg = model.config
        if max_len > cfg.block_size:
            raise TinyLMError(f"a cache of {max_len} positions exceeds the model's context "
                              f"(block_size = {cfg.block_size})")
        p = next(model.parameters())
        return cls([StaticKVCacheLayer(batch, cfg.kv_heads, max_len, cfg.head_dim, p.dtype, p.device)
                    for _ in range(cfg.n_layer)])

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, i):  # type: ignore[override]
        return self.layers[i]

    def __iter__(self) -> Iterator[StaticKVCacheLayer]:
        return iter(self.layers)

    @property
    def length(self) -> int:
        return self.layers[0].length

    @property
    def max_len(self) -> int:
        return self.layers[0].max_len

    @property
    def nbytes(self) -> int:
        """The memory the buffers take (all layers, keys and values)."""
        return sum(layer.k.nbytes + layer.v.nbytes for layer in self.layers)

    def filled_nbytes(self) -> int:
        """The bytes of the keys and values stored so far (what one decoding step reads)."""
        return self.nbytes * self.length // self.max_len

    def reorder(self, rows: Tensor) -> None:
        for layer in self.layers:
            layer.reorder(rows)
        if self.last_tokens is not None:
            self.last_tokens = self.last_tokens.index_select(0, rows)

    def reset(self) -> None:
        for layer in self.layers:
            layer.reset()
        self.last_tokens = None

    @classmethod
    def merged(cls, parts: Sequence[tuple[KVCache, Tensor]], width: int, capacity: int) -> KVCache:
        """The kept rows of several right-aligned caches (cache, rows kept) as one of ``capacity`` columns,
        filled to ``width`` (`merge_rows`); each row's last token goes with it (a bigram-hash model)."""
        layers = []
        for i in range(len(parts[0][0])):
            k = merge_rows([(c[i].k, rows, c.length) for c, rows in parts], width, capacity)  # (B, n_kv, S, hs)
            v = merge_rows([(c[i].v, rows, c.length) for c, rows in parts], width, capacity)
            layer = StaticKVCacheLayer(k.size(0), k.size(1), capacity, k.size(3), k.dtype, k.device)
            layer.k, layer.v = k, v
            layer._advance(width)
            layers.append(layer)
        cache = cls(layers)
        if all(c.last_tokens is not None for c, _ in parts):
            cache.last_tokens = torch.cat([c.last_tokens[rows] for c, rows in parts])
        return cache

    def truncate(self, length: int, last_tokens: Tensor | None = None) -> None:
        """Keep every layer's first ``length`` positions. A model with a bigram-hash table needs the token now
        last in the cache (B,) as ``last_tokens`` (the cache cannot know it: it stores keys, not tokens)."""
        for layer in self.layers:
            layer.truncate(length)
        if self.last_tokens is not None:
            if last_tokens is None:
                raise TinyLMError("this cache keeps each row's last token (a bigram-hash model): pass last_tokens")
            self.last_tokens = last_tokens
