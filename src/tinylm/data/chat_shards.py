"""Conversation shards: chats turned into token ids once, with which tokens a fine-tuned model learns to write.

`prepare_chats` writes a shard folder that `ShardSet.open` reads like any other (tokens per split,
tokenizer.json, meta.json), plus, per split, two files that plain text shards do not need:

- ``{split}.trained.bin``: one byte per token, 1 where the model is taught to write that token (the
  assistant's messages and the end-of-turn token closing each: `tinylm.tokenizers.chat_template.training_ids`),
  0 where it only reads it (system and user messages, the template's markers and role names);
- ``{split}.offsets.bin``: where each conversation starts in the split's tokens (int64), and its end:
  ``tokens[offsets[k]:offsets[k + 1]]`` is conversation k. No EOS separates conversations: a chat
  template may write EOS itself (Llama 2's ends every turn with ``</s>``), so the offsets say where
  one conversation ends.

Training packs conversations into rows of ``block_size`` positions (`pack_chats`, `packed_rows`; the
``chats`` batch mode of `tinylm.train.batches`); a token never attends across conversations, and a
target counts in the loss only where its token is trained. Evaluation reads one conversation per row
(`chat_rows`).
meta.json's ``chats`` entry names the files and counts, per split, the conversations, tokens and
trained tokens. The folder is written under temporary names and renamed into place, meta.json last.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tinylm.atomic import atomic_path, disk_writes
from tinylm.data.shards import META_FILE, SHARDS_FILE, SPLITS, TOKENIZER_FILE, ShardSet, token_dtype
from tinylm.errors import TinyLMError
from tinylm.tokenizers.base import Tokenizer
from tinylm.tokenizers.chat_template import training_ids

Conversation = Sequence[Mapping[str, Any]]


def chats_fingerprint(splits: Mapping[str, Sequence[Conversation]]) -> str:
    """A hash of the conversations of each split, in order: the same data gives the same fingerprint."""
    h = hashlib.sha256()
    for split in SPLITS:
        h.update(json.dumps([split, list(splits[split])], ensure_ascii=False, sort_keys=True).encode("utf-8"))
    return h.hexdigest()[:16]


def encode_chats(tokenizer: Tokenizer, conversations: Sequence[Conversation], block_size: int,
                 ) -> tuple[list[np.ndarray], list[np.ndarray], int]:
    """Each conversation's ids and trained flags (`training_ids`); conversations longer than ``block_size + 1``
    tokens keep their first ``block_size + 1`` (a row reads block_size tokens and predicts the next). Returns
    (ids per conversation, flags per conversation, how many were cut)."""
    ids_all, flags_all, cut = [], [], 0
    for conversation in conversations:
        ids, trained = training_ids(tokenizer, conversation)
        if len(ids) > block_size + 1:
            ids, trained, cut = ids[:block_size + 1], trained[:block_size + 1], cut + 1
        ids_all.append(np.asarray(ids, dtype=np.int64))
        flags_all.append(np.asarray(trained, dtype=np.uint8))
    return ids_all, flags_all, cut


def prepare_chats(splits: Mapping[str, Sequence[Conversation]], tokenizer: Tokenizer, out: str | os.PathLike, *,
                  block_size: int, source: str) -> ShardSet:
    """Write the conversations of each split (``{"train": [...], "val": [...]}``) into the shard folder ``out``
    (see the module docstring); ``source`` names where they came from (a file, ``tasks:add``). A folder that
    already holds these very conversations, tokenizer and block size is reused as it is."""
    out = Path(out)
    fingerprint = chats_fingerprint(splits)
    existing = _reusable(out, tokenizer, fingerprint, block_size)
    if existing is not None:
        return existing
    out.mkdir(parents=True, exist_ok=True)
    dtype = token_dtype(tokenizer.vocab_size)
    stats, chats = {}, {}
    with disk_writes(f"writing the conversation shards in {out}", "nothing half-written is left there"):
        for split in SPLITS:
            ids, flags, cut = encode_chats(tokenizer, splits[split], block_size)
            tokens = np.concatenate(ids).astype(dtype) if ids else np.empty(0, dtype)
            offsets = np.cumsum([0] + [len(a) for a in ids], dtype=np.int64)
            trained = np.concatenate(flags) if flags else np.empty(0, np.uint8)
            names = {"tokens": f"{split}.bin", "trained": f"{split}.trained.bin", "offsets": f"{split}.offsets.bin"}
            for key, array in (("tokens", tokens), ("trained", trained), ("offsets", offsets)):
                with atomic_path(out / names[key]) as temporary:
                    array.tofile(temporary)
            text_bytes = sum(len((m.get("content") or "").encode("utf-8")) for c in splits[split] for m in c)
            stats[split] = {"file": names["tokens"], "documents": len(ids), "tokens": int(len(tokens)),
                            "bytes": text_bytes}
            chats[split] = {"trained_file": names["trained"], "offsets_file": names["offsets"],
                            "trained_tokens": int(trained.sum()), "cut": cut}
        with atomic_path(out / TOKENIZER_FILE) as temporary:
            tokenizer.save(temporary)
        meta = {**SHARDS_FILE.header(), "corpus": source, "input_fingerprint": fingerprint,
                "tokenizer": {"kind": tokenizer.kind, "fingerprint": tokenizer.fingerprint(),
                              "vocab_size": tokenizer.vocab_size, "eos_id": tokenizer.eos_id, "file": TOKENIZER_FILE},
                "dtype": dtype.name, "val_fraction": None, "seed": None, "split_method": "conversations",
                "splits": stats, "skipped_documents": 0, "chats": {"block_size": block_size, **chats}}
        with atomic_path(out / META_FILE) as temporary:
            temporary.write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")
    return ShardSet.open(out)


def _reusable(out: Path, tokenizer: Tokenizer, fingerprint: str, block_size: int) -> ShardSet | None:
    if not (out / META_FILE).is_file():
        return None
    shards = ShardSet.open(out)
    meta = shards.meta
    same = (meta.get("input_fingerprint") == fingerprint and meta["tokenizer"]["fingerprint"] == tokenizer.fingerprint()
            and (meta.get("chats") or {}).get("block_size") == block_size)
    if not same:
        raise TinyLMError(f"{out} already holds other shards; choose another data folder or delete it")
    shards.reused = True
    return shards


def chat_arrays(shards: ShardSet, split: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A conversation shard split's (tokens, trained flags, offsets): conversation k is tokens[offsets[k]:offsets[k+1]]."""
    chats = shards.meta.get("chats")
    if not isinstance(chats, dict) or split not in chats:
        raise TinyLMError(f"{shards.path} holds text shards, not conversations; make them with `tinylm finetune`")
    tokens = shards.tokens(split)
    trained = np.fromfile(shards.path / chats[split]["trained_file"], dtype=np.uint8)
    offsets = np.fromfile(shards.path / chats[split]["offsets_file"], dtype=np.int64)
    if len(trained) != len(tokens) or len(offsets) < 1 or offsets[-1] != len(tokens) or np.any(np.diff(offsets) < 0):
        raise TinyLMError(f"the {split} conversation files in {shards.path} do not agree with its tokens; "
                          "make the shards again (delete the folder)")
    return tokens, trained, offsets


def chat_rows(tokens: np.ndarray, trained: np.ndarray, offsets: np.ndarray, chats: np.ndarray, block_size: int,
              pad_id: int, ignore_index: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Conversations ``chats`` one per row, right-padded to the longest (at most ``block_size`` inputs): inputs x,
    targets y (``ignore_index`` where the token is not trained, and at padding) and the mask of real inputs,
    (B, T) each."""
    starts, ends = offsets[chats], offsets[chats + 1]
    T = max(1, int(min(max(ends - starts) - 1, block_size)))
    x = np.full((len(chats), T), pad_id, dtype=np.int64)
    y = np.full((len(chats), T), ignore_index, dtype=np.int64)
    mask = np.zeros((len(chats), T), dtype=bool)
    for r, (a, b) in enumerate(zip(starts, ends)):
        n = int(min(b - a - 1, T))  # this row's inputs: every token but the last
        ids = tokens[a:a + n + 1].astype(np.int64)
        x[r, :n], mask[r, :n] = ids[:-1], True
        y[r, :n] = np.where(trained[a + 1:a + n + 1] > 0, ids[1:], ignore_index)
    return x, y, mask


def chat_opening(shards: ShardSet, split: str = "val") -> list[int]:
    """The first conversation of ``split`` up to its first trained token: a prompt for a reply (a training run's
    closing sample)."""
    tokens, trained, offsets = chat_arrays(shards, split)
    ids = tokens[offsets[0]:offsets[1]].astype(np.int64)
    first = np.flatnonzero(trained[offsets[0]:offsets[1]])
    return ids[:first[0] if len(first) else len(ids)].tolist()


def is_chats(shards: ShardSet) -> bool:
    """Whether ``shards`` hold conversations (`prepare_chats`) rather than text."""
    return isinstance(shards.meta.get("chats"), dict)


PACKING_OPEN_ROWS = 8  # rows still taking conversations while packing; more fill rows a little better, slower


def pack_chats(offsets: np.ndarray, order: np.ndarray, block_size: int) -> list[np.ndarray]:
    """Conversations ``order`` packed into rows of at most ``block_size`` positions: the conversations of each row.

    A conversation of L tokens fills L - 1 positions (every token but the last is an input, every token
    but the first a target), at most ``block_size`` (a longer one is cut). Each conversation in turn goes
    into the first of the last `PACKING_OPEN_ROWS` rows it fits in, or starts a new row; a row leaves the
    open set, full or not, when a ninth is opened. So the rows keep ``order``'s randomness and waste only
    the ends no conversation fits in. Conversations of a single token teach nothing and are left out.
    """
    positions = np.minimum(np.diff(offsets)[order] - 1, block_size)  # (n,)
    done: list[list[int]] = []
    open_rows: list[list[int]] = []
    room: list[int] = []
    for chat, n in zip(order.tolist(), positions.tolist()):
        if n <= 0:
            continue
        at = next((i for i, free in enumerate(room) if free >= n), None)
        if at is None:
            if len(open_rows) == PACKING_OPEN_ROWS:
                done.append(open_rows.pop(0))
                room.pop(0)
            open_rows.append([])
            room.append(block_size)
            at = len(open_rows) - 1
        open_rows[at].append(chat)
        room[at] -= n
    return [np.asarray(row, dtype=np.int64) for row in done + open_rows]


def packed_rows(tokens: np.ndarray, trained: np.ndarray, offsets: np.ndarray, rows: Sequence[np.ndarray],
                block_size: int, pad_id: int, ignore_index: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The packed ``rows`` (`pack_chats`) as inputs x, targets y and segment ids, (B, T) each, T the fullest row.

    Within a row, conversation k's positions have segment id k and the padding after the last one an id of its
    own, so no token attends across conversations (`tinylm.model.gpt.GPT`'s ``segment_ids``). A target is
    ``ignore_index`` where its token is not trained, and at padding.
    """
    starts, ends = offsets[:-1], offsets[1:]
    fill = [int(sum(min(ends[c] - starts[c] - 1, block_size) for c in row)) for row in rows]
    T = max(1, max(fill, default=1))
    x = np.full((len(rows), T), pad_id, dtype=np.int64)
    y = np.full((len(rows), T), ignore_index, dtype=np.int64)
    segments = np.empty((len(rows), T), dtype=np.int64)
    for r, row in enumerate(rows):
        at = 0
        for k, chat in enumerate(row.tolist()):
            a = int(starts[chat])
            n = int(min(ends[chat] - a - 1, block_size))
            ids = tokens[a:a + n + 1].astype(np.int64)
            x[r, at:at + n] = ids[:-1]
            y[r, at:at + n] = np.where(trained[a + 1:a + n + 1] > 0, ids[1:], ignore_index)
            segments[r, at:at + n] = k
            at += n
        segments[r, at:] = len(row)  # the padding: a segment of its own
    return x, y, segments
