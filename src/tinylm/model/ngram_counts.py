"""Counting n-grams, and the count tables on disk: what `tinylm.model.ngram.NGramModel` is built on.

An n-gram model is counts, then a smoothing rule over them (`tinylm.model.ngram`). This module is the
counting: a token stream is cut into documents and left-padded with BOS (`pad_documents`), every
window of length 1..n inside a document is counted (`count_ngrams`), and the counts are stored so
that a whole array of n-grams is looked up in a few vectorised passes (`lookup`, `suffix_rows`).

How the counts are stored
-------------------------
The n-grams of each order j form one level of a trie, stored as a sorted int64 array of keys::

    key(h w) = row(h) * |V| + w          (row(h): the index of h in the order-(j-1) array)

so an n-gram of any order is one integer (no |V|^n overflow: rows are bounded by the corpus
size), counting is ``np.unique`` with counts, lookup is ``np.searchsorted``, and the children
of a context are the contiguous slice ``[row(h) |V|, (row(h)+1) |V|)``. Scoring a whole token
array is n vectorised lookups, never a Python loop per token. Each level also keeps the row of
every n-gram's suffix (its back-off pointer), from which continuation counts are counted.

The file format
---------------
`save` writes one ``.npz`` file (numpy's zip of deflated ``.npy`` arrays, read with
``allow_pickle=False``, so loading runs no code):

- ``header``: uint8, the UTF-8 bytes of a JSON object ``{"format": "tinylm.ngram",
  "version": 1, "order", "vocab_size", "bos_id", "eos_id", "smoothing", "k", "discount",
  "discounts", "train_tokens", "train_documents", "tokenizer_fingerprint"}`` (the last is null
  for counts of bare ids, and absent from older files);
- ``keys_j`` (int64) and ``counts_j`` (uint32, or uint64 if a count needs it) for j = 1..n:
  the sorted keys of order j and how many times each n-gram ended at a training token
  (n-grams made only of ``<s>`` padding are kept as trie nodes with count 0).

Everything else (suffix pointers, continuation counts, discounts, the chain) is recomputed on
load: it is a few vectorised passes.
"""

from __future__ import annotations

import json
import os
import zipfile
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tinylm.atomic import atomic_path
from tinylm.errors import TinyLMError
from tinylm.jsonfile import JSONFormat

NGRAM_FILE = JSONFormat(
    "tinylm.ngram", 1,
    foreign='{path} is not a tinylm n-gram model (no "format": "{name}")',
    wrong_version="{path} has n-gram format version {found!r}, but this tinylm reads version {version}; "
                  "fit the model again",
)

TokenData = np.ndarray | Sequence[int] | Sequence[Sequence[int] | np.ndarray]


# ----- padding a token stream into documents -----------------------------------------------------


def as_stream(data: TokenData, eos_id: int) -> np.ndarray:
    """One int64 stream with EOS after every document (a list of documents gets EOS appended where missing)."""
    if isinstance(data, np.ndarray):
        return data.astype(np.int64, copy=False).reshape(-1)
    data = list(data)
    if data and all(isinstance(d, (int, np.integer)) for d in data):
        return np.asarray(data, dtype=np.int64)
    pieces = []
    for doc in data:
        doc = np.asarray(doc, dtype=np.int64).reshape(-1)
        if len(doc) == 0:
            continue  # an empty document is nothing to predict (prepare drops them too)
        pieces.append(doc)
        if doc[-1] != eos_id:
            pieces.append(np.array([eos_id], dtype=np.int64))
    return np.concatenate(pieces) if pieces else np.empty(0, dtype=np.int64)


def pad_documents(stream: np.ndarray, order: int, bos_id: int, eos_id: int
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Insert n-1 BOS before every document of an EOS-separated stream.

    Returns the padded stream P, each position's offset from its padded document's start
    (a window of length j ending at q lies inside one document iff offset[q] >= j - 1), and
    the positions of P that hold the original tokens (the targets), in order.
    """
    pad = order - 1
    n = len(stream)
    if n == 0:
        empty = np.empty(0, dtype=np.int64)
        return empty, empty, empty
    # document index of each token: a new document starts after every EOS
    doc = np.zeros(n, dtype=np.int64)
    np.cumsum(stream[:-1] == eos_id, out=doc[1:])
    n_docs = int(doc[-1]) + 1
    starts = np.flatnonzero(np.diff(doc, prepend=-1))  # (n_docs,) first token of each document
    targets = np.arange(n, dtype=np.int64) + (doc + 1) * pad
    padded = np.full(n + n_docs * pad, bos_id, dtype=np.int64)
    padded[targets] = stream
    offset = np.empty(len(padded), dtype=np.int64)
    offset[targets] = np.arange(n) - starts[doc] + pad
    pad_pos = (starts + np.arange(n_docs) * pad)[:, None] + np.arange(pad)  # (n_docs, pad)
    offset[pad_pos] = np.arange(pad)
    return padded, offset, targets


def lookup(keys: np.ndarray, query: np.ndarray) -> np.ndarray:
    """Row of each query key in the sorted ``keys``, or -1 where it is absent."""
    if len(keys) == 0:
        return np.full(len(query), -1, dtype=np.int64)
    i = np.searchsorted(keys, query)
    i_safe = np.minimum(i, len(keys) - 1)
    return np.where(keys[i_safe] == query, i_safe, -1)


# ----- counting -------------------------------------------------------------------------------------


def count_ngrams(stream: np.ndarray, order: int, vocab_size: int, bos_id: int, eos_id: int
                 ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The trie of every n-gram of orders 1..``order`` in an EOS-separated stream: (keys, counts) per order.

    keys[j-1] is the sorted int64 keys of order j, counts[j-1] how many times each ended at a real
    token of the stream (windows of padding only are kept as nodes with count 0).
    """
    padded, offset, targets = pad_documents(stream, order, bos_id, eos_id)
    is_target = np.zeros(len(padded), dtype=bool)
    is_target[targets] = True

    keys: list[np.ndarray] = []
    counts: list[np.ndarray] = []
    prev_rows = np.zeros(len(padded), dtype=np.int64)  # row of the empty context (order 0): 0
    for j in range(1, order + 1):
        check_key_room(len(keys[-1]) if keys else 1, vocab_size)
        # every window of length j that fits in its document, ending at position q
        q = np.flatnonzero(offset >= j - 1)
        prefix = prev_rows[q - 1] if j > 1 else 0  # row of the window's first j-1 tokens
        key_j, rows_j = np.unique(prefix * vocab_size + padded[q], return_inverse=True)
        keys.append(key_j)
        # counts are of n-grams ending at a real token; windows of padding only stay as nodes
        counts.append(np.bincount(rows_j[is_target[q]], minlength=len(key_j)))
        prev_rows = np.full(len(padded), -1, dtype=np.int64)
        prev_rows[q] = rows_j
    return keys, counts


def suffix_rows(keys: list[np.ndarray], vocab_size: int) -> list[np.ndarray]:
    """For each order j >= 2, the row (in order j-1) of every n-gram's suffix: h w without h's first token.

    The suffix of (prefix, w) is (suffix of prefix, w), so each order is one lookup into the
    order below. Every suffix of a counted window is itself a counted window.
    """
    V = vocab_size
    suffix: list[np.ndarray] = [np.zeros(len(keys[0]), dtype=np.int64)]  # order 1 -> the empty context
    for j in range(2, len(keys) + 1):
        prefix, word = np.divmod(keys[j - 1], V)
        rows = lookup(keys[j - 2], suffix[j - 2][prefix] * V + word) if j > 2 else lookup(keys[0], word)
        if (rows < 0).any():
            raise TinyLMError("the n-gram tables are inconsistent (a suffix is missing); the model file is corrupt")
        suffix.append(rows)
    return suffix


# ----- the file -----------------------------------------------------------------------------------


def write_tables(path: str | os.PathLike, header: dict[str, Any], keys: list[np.ndarray], counts: list[np.ndarray]
                 ) -> Path:
    """Write a model's JSON header and count tables as one .npz file (the module docstring), atomically."""
    arrays: dict[str, np.ndarray] = {
        "header": np.frombuffer(json.dumps(header).encode("utf-8"), dtype=np.uint8)
    }
    for j in range(1, len(keys) + 1):
        c = counts[j - 1]
        arrays[f"keys_{j}"] = keys[j - 1]
        arrays[f"counts_{j}"] = c.astype(np.uint32 if c.size == 0 or c.max() < 2**32 else np.uint64)
    with atomic_path(path) as tmp, open(tmp, "wb") as f:  # a file object: savez adds no suffix
        np.savez_compressed(f, **arrays)  # sorted keys share long prefixes, which deflate well
    return Path(path)


def read_tables(path: Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The JSON header (format and version checked) and every array of a file written by `write_tables`."""
    if not path.exists():
        raise TinyLMError(f"n-gram model file {path} does not exist")
    if path.is_file() and not zipfile.is_zipfile(path):  # a .npz is a zip archive; this is something else
        raise TinyLMError(f"{path} is not a readable n-gram model file (not a .npz archive: empty, cut short or "
                          "another kind of file); count it again")
    try:
        with np.load(path, allow_pickle=False) as npz:
            arrays = {name: npz[name] for name in npz.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error, NotImplementedError) as e:
        # (zlib.error: deflated data damaged; NotImplementedError: a damaged header naming no known compression)
        reason = str(e).split(";")[0].split(". ")[0]  # numpy's advice (e.g. allow_pickle) is not ours to give
        raise TinyLMError(f"{path} is not a readable n-gram model file ({reason}); count it again") from None
    try:
        header = json.loads(arrays["header"].tobytes().decode("utf-8"))
    except (KeyError, UnicodeDecodeError, json.JSONDecodeError):
        raise TinyLMError(f"{path} has no valid JSON header: it is not a tinylm n-gram model") from None
    return NGRAM_FILE.check(header, path), arrays


def check_tables(keys: list[np.ndarray], counts: list[np.ndarray], vocab_size: int) -> None:
    """The invariants every lookup relies on, for tables read from a file: one count per key, keys strictly
    increasing (binary search), each key ``row * |V| + w`` naming a row of the order below and a token."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size {vocab_size}")
    rows = 1  # order 1 has one context, the empty one
    for j, (k, c) in enumerate(zip(keys, counts), start=1):
        if k.dtype.kind not in "iu" or c.dtype.kind not in "iu":
            raise ValueError(f"the tables of order {j} hold {k.dtype} keys and {c.dtype} counts, not integers")
        if k.ndim != 1 or c.ndim != 1:
            raise ValueError(f"the tables of order {j} are not flat arrays (shapes {k.shape} and {c.shape})")
        if c.shape != k.shape:
            raise ValueError(f"order {j} has {k.size} keys but {c.size} counts")
        if k.size and (k[0] < 0 or k[-1] >= rows * vocab_size or np.any(np.diff(k) <= 0)):
            raise ValueError(f"the keys of order {j} are out of order or out of range")
        if c.size and c.min() < 0:
            raise ValueError(f"order {j} has negative counts")
        rows = k.size


# ----- checks -------------------------------------------------------------------------------------


def check_ids(stream: np.ndarray, vocab_size: int) -> None:
    if len(stream) and (stream.min() < 0 or stream.max() >= vocab_size):
        bad = stream[(stream < 0) | (stream >= vocab_size)][0]
        raise TinyLMError(f"token id {bad} is outside the vocabulary 0..{vocab_size - 1}; use the model's tokenizer")


def check_key_room(n_contexts: int, vocab_size: int) -> None:
    # keys are row * |V| + w in int64; rows are bounded by the corpus size, so this holds far past any real corpus
    if n_contexts * vocab_size >= 2**63:
        raise TinyLMError(
            f"{n_contexts} contexts x {vocab_size} tokens do not fit the int64 keys; use less text or a lower order"
        )
