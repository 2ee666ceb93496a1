"""The prefix cache: keys and values of earlier prompts kept, so a prompt that starts the same way skips that part.

A chat's next turn sends the whole conversation again: the earlier turns' tokens, then a few new ones.
In a causal Transformer the keys and values of position t depend only on tokens 0..t, so when a new
prompt's token ids begin with ids already read (an earlier prompt and its reply), their keys and values
are the ones computed then. `PrefixCache` keeps them, one entry per sequence read, keyed by the token ids;
`PrefixCache.resume` copies the longest common prefix into a fresh decoder and runs the model on the rest
only. The result is the recomputation's up to float rounding (the same products, summed over a different
split of the prompt): the tests pin greedy tokens equal and logits close.

**What an entry holds.** One sequence's keys and values, (n_layer, n_kv, L, hs) each, copied out of the
decoder that read it (`row_kv`), with positions 0..L-1 (a row's tokens count from 0 whatever its column in
a padded batch). A new prompt that shares only its first m tokens with an entry reuses those m positions
(`common_prefix`); the rest of the entry is ignored. At least the prompt's last token is always run, since
its logits give the first new token.

**Bounds.** Entries are kept in least-recently-used order and evicted when their bytes exceed the budget
(``budget_bytes``) or their number ``max_entries`` (the lookup compares the prompt with every entry). An
entry whose ids begin another's is dropped when the longer one is stored: the longer serves every prompt
the shorter did. ``namespace`` separates what must not be shared, e.g. LoRA adapters, whose keys differ.

**Where it does not apply** (`reusable`): a bigram-hash model (its cache also needs the last token read),
and models that keep another kind of state (an RNN's, an n-gram's). Callers recompute there, and for
batches of several prompts, and for windows that slid (the engine keys an entry by the window it read).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from tinylm.errors import TinyLMError
from tinylm.generate.cache import KVCache
from tinylm.generate.fast import StaticDecoder
from tinylm.generate.steps import CachedDecoder

MAX_ENTRIES = 64  # the most entries a cache keeps whatever their size: every lookup compares with each
SERVE_BUDGET_MB = 256  # `tinylm serve --prefix-cache-mb` by default


@dataclass
class CachedPrefix:
    """One sequence's token ids and its keys and values, (n_layer, n_kv, L, hs) each."""

    ids: tuple[int, ...]
    k: Tensor
    v: Tensor

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many tokens ``a`` and ``b`` share from the start."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def reusable(decoder: object) -> bool:
    """Whether keys and values can be copied into and out of ``decoder``: a GPT's `StaticDecoder`, or the model's
    own `KVCache` without a bigram-hash table (whose cache also keeps the last token read)."""
    if isinstance(decoder, StaticDecoder):
        return True
    return (isinstance(decoder, CachedDecoder) and isinstance(decoder.cache, KVCache)
            and not getattr(decoder.model.config, "bigram_hash", 0))


def row_kv(decoder: StaticDecoder | CachedDecoder, row: int, n: int) -> tuple[Tensor, Tensor]:
    """Copies of row ``row``'s last ``n`` cached positions (a row's tokens end at column ``length - 1``):
    keys and values (n_layer, n_kv, n, hs) each."""
    end = decoder.length
    if isinstance(decoder, StaticDecoder):
        return decoder.k[:, row, :, end - n:end].clone(), decoder.v[:, row, :, end - n:end].clone()
    layers = decoder.cache.layers
    return (torch.stack([layer.k[row, :, end - n:end] for layer in layers]),
            torch.stack([layer.v[row, :, end - n:end] for layer in layers]))


def load_prefix(decoder: StaticDecoder | CachedDecoder, entry: CachedPrefix, n: int) -> None:
    """Forget what ``decoder`` (one row) holds and give it ``entry``'s first ``n`` positions, as if it had read them."""
    decoder.reset()
    if isinstance(decoder, StaticDecoder):
        decoder.k[:, 0, :, :n] = entry.k[:, :, :n]
        decoder.v[:, 0, :, :n] = entry.v[:, :, :n]
    else:
        for i, layer in enumerate(decoder.cache.layers):
            layer.k[0, :, :n] = entry.k[i, :, :n]
            layer.v[0, :, :n] = entry.v[i, :, :n]
            layer._advance(n)
        decoder.padded = False
    decoder.mask[:, :n] = True
    decoder.length = n
    decoder.next_position = torch.full_like(decoder.next_position, n)


def read_rest(decoder: StaticDecoder | CachedDecoder, ids: Sequence[int]) -> Tensor:
    """Run ``ids`` (one row) after what ``decoder`` holds; the last one's logits (1, V)."""
    tokens = torch.tensor([list(ids)], dtype=torch.long, device=decoder.mask.device)  # (1, T)
    if isinstance(decoder, StaticDecoder):  # the head's product for the last position only
        positions = decoder.next_position + torch.arange(tokens.size(1), device=tokens.device)
        return decoder.run(tokens, positions, last=True)[:, -1]
    return decoder.extend(tokens)[:, -1]


class PrefixCache:
    """Keys and values of sequences read before, by token ids, least recently used evicted first (module docstring).

    ``budget_bytes`` bounds the bytes of all entries (None: no bound); ``max_entries`` their number.
    ``reused`` and ``computed`` count the prompt tokens `resume` took from the cache and ran through the model.
    """

    def __init__(self, budget_bytes: int | None, max_entries: int = MAX_ENTRIES) -> None:
        if budget_bytes is not None and budget_bytes < 0:
            raise TinyLMError(f"the prefix cache's budget must be 0 or more bytes, got {budget_bytes}")
        if max_entries < 1:
            raise TinyLMError(f"the prefix cache keeps at least one entry, got max_entries={max_entries}")
        self.budget = budget_bytes
        self.max_entries = max_entries
        self.entries: OrderedDict[tuple[int, tuple[int, ...]], CachedPrefix] = OrderedDict()  # oldest first
        self.nbytes = 0
        self.reused = 0
        self.computed = 0
        self.evicted = 0

    @classmethod
    def megabytes(cls, mb: float) -> PrefixCache | None:
        """A cache of ``mb`` megabytes (2**20 bytes), or None for 0: what ``--prefix-cache-mb`` asks for."""
        if mb < 0:
            raise TinyLMError(f"--prefix-cache-mb must be 0 (off) or more, got {mb:g}")
        return cls(int(mb * 2**20)) if mb > 0 else None

    def __len__(self) -> int:
        return len(self.entries)

    def lookup(self, ids: Sequence[int], namespace: int = 0) -> tuple[CachedPrefix | None, int]:
        """The entry sharing the most leading tokens with ``ids``, and how many of them may be reused: at most
        ``len(ids) - 1``, so the last token is run for its logits. (None, 0) when nothing is shared."""
        best, most = None, 0
        for (space, _), entry in self.entries.items():
            if space == namespace:
                n = common_prefix(entry.ids, ids)
                if n > most:
                    best, most = entry, n
        most = min(most, len(ids) - 1)
        if best is None or most < 1:
            return None, 0
        self.entries.move_to_end((namespace, best.ids))
        return best, most

    def store(self, ids: Sequence[int], k: Tensor, v: Tensor, namespace: int = 0) -> None:
        """Keep the keys and values (n_layer, n_kv, len(ids), hs) of ``ids``; evict the least recently used entries
        beyond the budget. Entries whose ids begin ``ids`` go (this one serves their prompts too); if ``ids``
        begins a kept entry, that entry is only marked used."""
        ids = tuple(ids)
        if not ids or k.size(2) != len(ids):
            raise TinyLMError(f"a prefix of {len(ids)} tokens needs keys for {len(ids)} positions, got {k.size(2)}")
        entry = CachedPrefix(ids, k, v)
        if self.budget is not None and entry.nbytes > self.budget:
            return
        for key, kept in list(self.entries.items()):
            if key[0] != namespace:
                continue
            if len(kept.ids) >= len(ids) and kept.ids[:len(ids)] == ids:
                self.entries.move_to_end(key)
                return
            if kept.ids == ids[:len(kept.ids)]:
                self._drop(key)
        self.entries[(namespace, ids)] = entry
        self.nbytes += entry.nbytes
        while len(self.entries) > self.max_entries or (self.budget is not None and self.nbytes > self.budget):
            self._drop(next(iter(self.entries)))
            self.evicted += 1

    def _drop(self, key: tuple[int, tuple[int, ...]]) -> None:
        self.nbytes -= self.entries.pop(key).nbytes

    def clear(self) -> None:
        self.entries.clear()
        self.nbytes = 0

    def resume(self, decoder: StaticDecoder | CachedDecoder, ids: Sequence[int], namespace: int = 0) -> tuple[Tensor, int]:
        """Read the prompt ``ids`` (one row) into a fresh ``decoder``: the longest cached prefix copied in, the rest
        run through the model. The last position's logits (1, V), and how many tokens came from the cache (0
        where nothing matched or the decoder cannot take keys: then the whole prompt is read)."""
        entry, n = self.lookup(ids, namespace) if reusable(decoder) else (None, 0)
        if entry is None:
            idx = torch.tensor([list(ids)], dtype=torch.long, device=decoder.mask.device)
            logits = decoder.start(idx, torch.ones_like(idx, dtype=torch.bool))
        else:
            load_prefix(decoder, entry, n)
            logits = read_rest(decoder, ids[n:])
        self.reused += n
        self.computed += len(ids) - n
        return logits, n

    def remember(self, decoder: StaticDecoder | CachedDecoder, row: int, ids: Sequence[int], namespace: int = 0) -> None:
        """Store row ``row`` of ``decoder``, whose last ``len(ids)`` cached positions are ``ids``'s (nothing where the
        decoder cannot give keys, or holds fewer positions)."""
        if ids and reusable(decoder) and decoder.length >= len(ids):
            self.store(ids, *row_kv(decoder, row, len(ids)), namespace=namespace)
