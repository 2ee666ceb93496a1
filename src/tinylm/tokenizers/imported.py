"""Tokenizers made by other tools, kept with their own ids: byte-level BPE and SentencePiece-style BPE.

A model trained elsewhere was trained on its tokenizer's ids, so an imported tokenizer keeps every
id where its author put it. `ByteLevelBPETokenizer` (kind "bytelevel": GPT-2, SmolLM, Llama 3,
Qwen2, cl100k/o200k) runs on tiktoken's core where it can (`TiktokenPath`);
`SentencePieceBPETokenizer` (kind "sentencepiece": Llama 2, TinyLlama, Mistral) merges characters
with "▁" for spaces and byte fallback. Both keep the chat template, the roles and ``stop_ids``.
`tinylm.tokenizers.hf_files` reads the files into these classes; docs/tokenizers.md has the details.
"""

from __future__ import annotations

import base64
import functools
import heapq
import unicodedata
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import regex
import tiktoken

from tinylm.errors import TinyLMError
from tinylm.tokenizers.base import AllowedSpecial, StreamDecoder, Tokenizer, whole_number, without_lone_surrogates
from tinylm.tokenizers.bpe import PATTERNS, TiktokenPath, pattern_name, resolve_pattern

NORMALIZERS = ("NFC", "NFKC", "NFD", "NFKD")
SPACE_MARK = "\u2581"  # "▁": SentencePiece's stand-in for a space

# Ids index lists here, so one id far past the others (a typo, or a 10 KB file with an id of 10**9) would
# allocate every id below it. Real vocabularies leave a few ids unused (a gap before the special tokens, slots a
# trainer reserved): up to this many, or a tenth of the ids in use if that is more, is far above any of them.
MAX_UNUSED_IDS = 1024


def checked_vocab_size(ids: Iterable[tuple[Any, int]], at_least: int = 0, *, source: str | None = None,
                       what: str = "id") -> int:
    """The vocabulary size that (name, id) pairs need, checked before a list of that size is allocated.

    Every id must be a whole number from 0, and the ids (with ``at_least``, a size the file states) may leave
    only `MAX_UNUSED_IDS` (or a tenth of the ids in use) unused; otherwise a `TinyLMError` names the entry
    (and ``source``, the file). ``what`` is what the file calls an id ("rank" in a .tiktoken file).
    """
    def refuse(message: str) -> TinyLMError:
        return TinyLMError(f"{source}: {message}" if source else message)

    used: set[int] = set()
    top_name, top = None, -1
    for name, i in ids:
        if isinstance(i, bool) or not isinstance(i, int) or i < 0:
            raise refuse(f"token {name!r} has {what} {i!r}; {what}s are whole numbers from 0")
        used.add(i)
        if i > top:
            top_name, top = name, i
    size = max(top + 1, at_least)
    allowed = max(MAX_UNUSED_IDS, len(used) // 10)
    if size - len(used) > allowed:
        entry, wrong = ((f"token {top_name!r} has {what} {top:,}", f"that {what}") if top + 1 >= at_least else
                        (f"the vocabulary size is {size:,}", "that size"))
        raise refuse(f"{entry}, but only {len(used):,} {what}s are in use ({what}s run from 0 with at most "
                     f"{allowed:,} unused), so {wrong} is wrong")
    return size


class ImportedTokenizer(Tokenizer):
    """What both imported kinds share: specials at their own ids, roles, added words, a chat template."""

    def _init_imported(self, vocab_size: int, specials: dict[str, int], roles: dict[str, str], *,
                       add_bos: bool, added_words: dict[str, int] | None, chat_template: str | None,
                       stop_ids: Sequence[int] = ()) -> None:
        self._vocab_size = vocab_size
        self.n_reserved = 0
        self.add_bos = bool(add_bos)
        self.added_words = dict(added_words or {})
        self.chat_template = chat_template
        self.stop_ids = sorted({int(i) for i in stop_ids})
        for name, i in {**specials, **self.added_words, **{f"stop id {i}": i for i in self.stop_ids}}.items():
            if not 0 <= i < vocab_size:
                raise ValueError(f"token {name!r} has id {i}, outside the vocabulary 0..{vocab_size - 1}")
        self._set_specials(specials, roles)
        self._added_split = (regex.compile("(" + "|".join(regex.escape(w) for w in
                                                         sorted(self.added_words, key=len, reverse=True)) + ")")
                             if self.added_words else None)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def base_vocab_size(self) -> int:
        return self._vocab_size

    def pipeline_start_ids(self) -> list[int]:
        # the model was trained on what its tokenizer makes of a text: BOS first where the post-processor
        # puts it there, nothing where it puts nothing (Qwen2, GPT-2, many Mistral files)
        return [self.bos_id] if self.add_bos else []

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_bytes or not self._has_token(token_id)

    def _has_token(self, token_id: int) -> bool:
        raise NotImplementedError

    def encode_ordinary(self, text: str) -> list[int]:
        return self._encode_text(without_lone_surrogates(text), first=True)

    def encode(self, text: str, *, allowed_special: AllowedSpecial = ()) -> list[int]:
        allowed = self._allowed(allowed_special)
        text = without_lone_surrogates(text)
        if not allowed:
            return self._encode_text(text, first=True)
        ids: list[int] = []
        for i, piece in enumerate(self._split_specials(text, allowed)):
            if i % 2:
                ids.append(self.special_tokens[piece])
            elif piece:
                ids.extend(self._encode_text(piece, first=i == 0))  # only the first piece starts the text
        return ids

    def _encode_text(self, text: str, first: bool) -> list[int]:
        """Text without special tokens: cut out the added words, encode what lies between them."""
        if self._added_split is None:
            return self._encode_piece(text, first)
        ids: list[int] = []
        for i, piece in enumerate(self._added_split.split(text)):
            if i % 2:
                ids.append(self.added_words[piece])
            elif piece:
                ids.extend(self._encode_piece(piece, first and i == 0))
        return ids

    def _encode_piece(self, text: str, first: bool) -> list[int]:
        raise NotImplementedError

    def _common_dict(self) -> dict[str, Any]:
        return {"vocab_size": self._vocab_size, "roles": self.roles, "add_bos": self.add_bos,
                "added_words": self.added_words, "chat_template": self.chat_template, "stop_ids": self.stop_ids}

    @staticmethod
    def _common_args(data: dict[str, Any]) -> dict[str, Any]:
        return {"vocab_size": whole_number(data["vocab_size"], "vocab_size"), "specials": dict(data["special_tokens"]),
                "roles": dict(data["roles"]), "add_bos": bool(data["add_bos"]),
                "added_words": dict(data.get("added_words") or {}), "chat_template": data.get("chat_template"),
                "stop_ids": [whole_number(i, "a stop id") for i in data.get("stop_ids") or ()]}


def _encode_token_list(tokens: Sequence[bytes | None]) -> list[str | None]:
    return [None if t is None else base64.b64encode(t).decode("ascii") for t in tokens]


def _decode_token_list(items: Sequence[str | None]) -> list[bytes | None]:
    return [None if t is None else base64.b64decode(t, validate=True) for t in items]


# ----- byte-level BPE with any id layout -------------------------------------------------------------


class ByteLevelBPETokenizer(ImportedTokenizer, TiktokenPath):
    """Byte-level BPE whose tokens, bytes and specials have any ids (GPT-2, Llama 3, Qwen2, cl100k...).

    ``tokens[i]`` is the bytes of id i (None for a special token or an id no token uses); ``merges``
    the merge list as pairs of ids, earliest first (empty: the ids are the merge order, as in a
    .tiktoken file). ``ignore_merges`` (Llama 3's setting) lets a chunk that is itself a token be
    that token without running BPE, which then may use every token, not only merge results.
    """

    kind = "bytelevel"

    def __init__(self, tokens: Sequence[bytes | None], merges: Sequence[tuple[int, int]], pattern: str,
                 *, specials: dict[str, int], roles: dict[str, str], vocab_size: int | None = None,
                 add_prefix_space: bool = False, normalizer: str | None = None, ignore_merges: bool = False,
                 add_bos: bool = False, added_words: dict[str, int] | None = None,
                 chat_template: str | None = None, stop_ids: Sequence[int] = ()) -> None:
        self.tokens: list[bytes | None] = list(tokens)
        vocab_size = checked_vocab_size([*((b, i) for i, b in enumerate(self.tokens) if b is not None),
                                         *specials.items(), *(added_words or {}).items()],
                                        max(vocab_size or 0, len(self.tokens)))
        self.tokens += [None] * (vocab_size - len(self.tokens))
        self.pattern = resolve_pattern(pattern)
        self._split = regex.compile(self.pattern)
        if normalizer is not None and normalizer not in NORMALIZERS:
            raise ValueError(f"normalizer {normalizer!r} is not one of {NORMALIZERS}")
        self.normalizer = normalizer
        self.add_prefix_space = bool(add_prefix_space)
        self.ignore_merges = bool(ignore_merges)
        self.merges = [(int(a), int(b)) for a, b in merges]
        self._init_imported(vocab_size, specials, roles, add_bos=add_bos, added_words=added_words,
                            chat_template=chat_template, stop_ids=stop_ids)
        self._token_ids, self._byte_ids = self._ranks()

    def _ranks(self) -> tuple[dict[bytes, int], np.ndarray]:
        """The tokens BPE may produce, bytes -> id (tiktoken's ranks), and each single byte's id."""
        ids_of: dict[bytes, int] = {}
        for i, b in enumerate(self.tokens):
            if b is not None and b not in ids_of and i not in self._special_bytes:
                ids_of[b] = i
        byte_ids = np.array([ids_of.get(bytes([b]), -1) for b in range(256)], dtype=np.int64)
        missing = np.flatnonzero(byte_ids < 0)
        if len(missing):
            raise TinyLMError(
                f"the vocabulary lacks {len(missing)} of the 256 single bytes (such as {bytes([int(missing[0])])!r}), "
                "so some text has no spelling in it; byte-level BPE needs all 256 (train it with the ByteLevel "
                "initial alphabet)")
        if not self.merges:  # a .tiktoken file: every token, ranked by its id
            return ids_of, byte_ids
        ranks = {bytes([b]): int(byte_ids[b]) for b in range(256)}
        last = -1
        for r, (a, b) in enumerate(self.merges):
            for side in (a, b):
                if not 0 <= side < len(self.tokens) or self.tokens[side] is None:
                    raise ValueError(f"merge {r} ({a}, {b}) uses id {side}, which is not a token")
            joined = self.tokens[a] + self.tokens[b]
            made = ids_of.get(joined)
            if made is None:
                raise ValueError(f"merge {r} makes {joined!r}, which is not in the vocabulary")
            if joined in ranks:
                continue  # made by an earlier merge already: tiktoken ranks a token once
            if made <= last:
                raise TinyLMError(
                    f"merge {r} makes id {made}, below the id {last} of an earlier merge: this tokenizer's ids do "
                    "not follow its merge order, which tinylm's (tiktoken's) BPE needs")
            ranks[joined] = last = made
        if self.ignore_merges:  # a chunk may be any token as a whole
            for b, i in ids_of.items():
                ranks.setdefault(b, i)
        return ranks, byte_ids

    def _has_token(self, token_id: int) -> bool:
        return 0 <= token_id < len(self.tokens) and self.tokens[token_id] is not None

    def _base_token_bytes(self, token_id: int) -> bytes:
        return self.tokens[token_id] or b""

    @functools.cached_property
    def _id_bytes(self) -> Sequence[bytes]:
        return [b or b"" for b in self.tokens]

    @functools.cached_property
    def tiktoken_encoding(self) -> tiktoken.Encoding:
        # no special tokens: they are cut out of the text before tiktoken sees it
        return tiktoken.Encoding(name=f"tinylm-bytelevel-{self._vocab_size}", pat_str=self.pattern,
                                 mergeable_ranks=self._token_ids, special_tokens={})

    def _encode_piece(self, text: str, first: bool) -> list[int]:
        if self.normalizer is not None:
            text = unicodedata.normalize(self.normalizer, text)
        if self.add_prefix_space and not text.startswith(" "):
            text = " " + text
        return TiktokenPath.encode_ordinary(self, text)

    def _to_dict(self) -> dict[str, Any]:
        return {**self._common_dict(), "pattern": pattern_name(self.pattern) or self.pattern,
                "tokens": _encode_token_list(self.tokens), "merges": [list(m) for m in self.merges],
                "add_prefix_space": self.add_prefix_space, "normalizer": self.normalizer,
                "ignore_merges": self.ignore_merges}

    @classmethod
    def _from_dict(cls, data: dict[str, Any]) -> ByteLevelBPETokenizer:
        return cls(_decode_token_list(data["tokens"]), [tuple(m) for m in data["merges"]], data["pattern"],
                   add_prefix_space=bool(data["add_prefix_space"]), normalizer=data["normalizer"],
                   ignore_merges=bool(data["ignore_merges"]), **cls._common_args(data))


# ----- SentencePiece-style BPE with byte fallback ------------------------------------------------------

PREFIX_MODES = ("prepend", "first", "always", "never")


class SentencePieceBPETokenizer(ImportedTokenizer):
    """BPE over characters with "▁" for spaces and byte fallback: Llama 2, TinyLlama, Mistral.

    ``pieces[i]`` is the text of id i ("▁the", "<0x0A>", or None for a special token or an unused id);
    ``merges`` pairs of ids in rank order. ``prefix`` says where a "▁" goes in front: "prepend" (the
    `Prepend` normalizer: before every piece of text), "first" or "always" (the `Metaspace`
    pre-tokenizer: before the text's first piece, or every piece, unless it already starts with
    "▁"), or "never". ``split`` cuts the text before every "▁" first (Metaspace's split=true).
    """

    kind = "sentencepiece"

    def __init__(self, pieces: Sequence[str | None], merges: Sequence[tuple[int, int]], *,
                 specials: dict[str, int], roles: dict[str, str], unk: str | None = None, byte_fallback: bool = True,
                 fuse_unk: bool = True, prefix: str = "prepend", split: bool = False,
                 strip_leading_space: bool = True, vocab_size: int | None = None, add_bos: bool = True,
                 added_words: dict[str, int] | None = None, chat_template: str | None = None,
                 stop_ids: Sequence[int] = ()) -> None:
        if prefix not in PREFIX_MODES:
            raise ValueError(f"prefix {prefix!r} is not one of {PREFIX_MODES}")
        self.pieces: list[str | None] = list(pieces)
        vocab_size = checked_vocab_size([*((p, i) for i, p in enumerate(self.pieces) if p is not None),
                                         *specials.items(), *(added_words or {}).items()],
                                        max(vocab_size or 0, len(self.pieces)))
        self.pieces += [None] * (vocab_size - len(self.pieces))
        # A byte token ("<0xC3>") that the file also lists as a special added token (as a `tokenizers` trainer
        # given them as special_tokens writes it) is still a byte: `tokenizers` finds byte fallback's tokens in
        # the model's vocabulary whatever else it says about them, and its decoder turns them into bytes. So it
        # is kept as an added word here (cut out of text like any added token, never a special to skip).
        byte_specials = {name: i for name, i in specials.items() if _is_byte_piece(name)
                         and name not in roles.values()}
        if byte_specials:
            specials = {name: i for name, i in specials.items() if name not in byte_specials}
            added_words = {**(added_words or {}), **byte_specials}
            for name, i in byte_specials.items():
                if i < len(self.pieces):
                    self.pieces[i] = name
        self.prefix, self.split_on_mark = prefix, bool(split)
        self.byte_fallback, self.fuse_unk = bool(byte_fallback), bool(fuse_unk)
        self.strip_leading_space = bool(strip_leading_space)
        self.unk = unk
        self._init_imported(vocab_size, specials, roles, add_bos=add_bos, added_words=added_words,
                            chat_template=chat_template, stop_ids=stop_ids)
        self._ids = {p: i for i, p in enumerate(self.pieces) if p is not None}
        for name, i in specials.items():  # "<unk>" is both a special token and the model's unknown piece
            self._ids.setdefault(name, i)
        if unk is not None and unk not in self._ids:
            raise ValueError(f"the unknown token {unk!r} is not in the vocabulary")
        self._unk_id = self._ids[unk] if unk is not None else None
        self._bytes_of: list[bytes | None] = [None] * vocab_size
        self._byte_token = [-1] * 256
        for i, p in enumerate(self.pieces):
            if p is None:
                continue
            m = _BYTE_PIECE.fullmatch(p)
            if m:
                b = int(m.group(1), 16)
                self._bytes_of[i] = bytes([b])
                if _is_byte_piece(p) and self._byte_token[b] < 0:  # byte fallback looks up "<0x%02X>" only
                    self._byte_token[b] = i
            else:
                self._bytes_of[i] = p.replace(SPACE_MARK, " ").encode("utf-8")
        self.merges = [(int(a), int(b)) for a, b in merges]
        self._merge: dict[tuple[int, int], tuple[int, int]] = {}
        for r, (a, b) in enumerate(self.merges):
            pa, pb = self.pieces[a] if 0 <= a < vocab_size else None, self.pieces[b] if 0 <= b < vocab_size else None
            made = self._ids.get(pa + pb) if pa is not None and pb is not None else None
            if made is None:
                raise ValueError(f"merge {r} ({a}, {b}) does not join two pieces into a piece of the vocabulary")
            self._merge.setdefault((a, b), (r, made))
        # Text can be cut before every "▁" that follows another character when no piece has a "▁" after
        # another character: no merge can then cross such a cut, and each word is merged (and cached) alone.
        self._cut_words = self.split_on_mark or not any(
            _MARK_INSIDE.search(p) for p in self.pieces if p is not None)

    @property
    def unk_id(self) -> int | None:
        return self._unk_id

    def _has_token(self, token_id: int) -> bool:
        return 0 <= token_id < len(self.pieces) and self.pieces[token_id] is not None

    def _base_token_bytes(self, token_id: int) -> bytes:
        return self._bytes_of[token_id] or b""

    def decode(self, ids: Iterable[int], errors: str = "replace") -> str:
        ids = [int(i) for i in ids]
        text = super().decode(ids, errors) if errors != "replace" else self._decode_byte_runs(ids)
        return text[1:] if self.strip_leading_space and text.startswith(" ") else text

    def stream_decoder(self) -> StreamDecoder:
        return _ByteRunStreamDecoder(self)

    def _is_byte_token(self, i: int) -> bool:
        return 0 <= i < len(self.pieces) and i not in self._special_bytes and self.pieces[i] is not None \
            and _BYTE_PIECE.fullmatch(self.pieces[i]) is not None

    def _byte_run_text(self, run: list[int]) -> str:
        data = b"".join(self._bytes_of[i] or b"" for i in run)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            return "\ufffd" * len(run)

    def _decode_byte_runs(self, ids: list[int]) -> str:
        """Text as `tokenizers`' ByteFallback decoder makes it: each run of byte tokens is UTF-8 text, or one
        U+FFFD per byte token where it is not (Python's decoder would keep the ASCII bytes of a broken run)."""
        parts: list[str] = []
        run: list[int] = []
        for i in ids:
            if self._is_byte_token(i):
                run.append(i)
                continue
            if run:
                parts.append(self._byte_run_text(run))
                run = []
            parts.append(self.token_bytes(i).decode("utf-8", errors="replace"))
        if run:
            parts.append(self._byte_run_text(run))
        return "".join(parts)

    def _encode_piece(self, text: str, first: bool) -> list[int]:
        text = text.replace(" ", SPACE_MARK)
        if self.prefix == "prepend" or (self.prefix == "always" or (self.prefix == "first" and first)) \
                and not text.startswith(SPACE_MARK):
            text = SPACE_MARK + text
        if not self._cut_words:
            return self._merge_word(text)
        ids: list[int] = []
        for word in (_WORDS_SPLIT if self.split_on_mark else _WORDS).findall(text):
            if word:
                ids.extend(self._cached_word(word))
        return ids

    @functools.lru_cache(maxsize=1 << 16)  # noqa: B019 (one cache per tokenizer is what we want)
    def _cached_word(self, word: str) -> tuple[int, ...]:
        return tuple(self._merge_word(word))

    def _symbols(self, text: str) -> list[int]:
        """Each character's id; a character without one as its byte tokens, or <unk> (runs fused)."""
        out: list[int] = []
        for ch in text:
            i = self._ids.get(ch)
            if i is not None:
                out.append(i)
                continue
            if self.byte_fallback:
                spelled = [self._byte_token[b] for b in ch.encode("utf-8")]
                if all(t >= 0 for t in spelled):
                    out.extend(spelled)
                    continue
            if self._unk_id is None:
                raise TinyLMError(f"the character {ch!r} has no token and this tokenizer has no <unk>")
            if not (self.fuse_unk and out and out[-1] == self._unk_id):
                out.append(self._unk_id)
        return out

    def _merge_word(self, text: str) -> list[int]:
        """BPE on one word: merge the adjacent pair of lowest rank (leftmost first) until none has a merge."""
        sym = self._symbols(text)
        n = len(sym)
        if n < 2:
            return sym
        nxt, prv, alive = list(range(1, n + 1)), list(range(-1, n - 1)), [True] * n
        nxt[-1] = -1
        merge = self._merge
        heap = [(rank_made[0], i, rank_made[1]) for i in range(n - 1)
                if (rank_made := merge.get((sym[i], sym[i + 1]))) is not None]
        heapq.heapify(heap)
        while heap:
            rank, i, made = heapq.heappop(heap)
            j = nxt[i]
            if not alive[i] or j < 0 or merge.get((sym[i], sym[j]), (None, None))[1] != made:
                continue  # stale: one side merged since this pair was queued
            sym[i] = made
            alive[j] = False
            nxt[i] = nxt[j]
            if nxt[j] >= 0:
                prv[nxt[j]] = i
            if prv[i] >= 0 and (m := merge.get((sym[prv[i]], made))) is not None:
                heapq.heappush(heap, (m[0], prv[i], m[1]))
            if nxt[i] >= 0 and (m := merge.get((made, sym[nxt[i]]))) is not None:
                heapq.heappush(heap, (m[0], i, m[1]))
        return [sym[i] for i in range(n) if alive[i]]

    def _to_dict(self) -> dict[str, Any]:
        return {**self._common_dict(), "pieces": self.pieces, "merges": [list(m) for m in self.merges],
                "unk": self.unk, "byte_fallback": self.byte_fallback, "fuse_unk": self.fuse_unk,
                "prefix": self.prefix, "split": self.split_on_mark, "strip_leading_space": self.strip_leading_space}

    @classmethod
    def _from_dict(cls, data: dict[str, Any]) -> SentencePieceBPETokenizer:
        return cls(data["pieces"], [tuple(m) for m in data["merges"]], unk=data["unk"],
                   byte_fallback=bool(data["byte_fallback"]), fuse_unk=bool(data["fuse_unk"]), prefix=data["prefix"],
                   split=bool(data["split"]), strip_leading_space=bool(data["strip_leading_space"]),
                   **cls._common_args(data))


class _ByteRunStreamDecoder(StreamDecoder):
    """`SentencePieceBPETokenizer.decode` as tokens arrive: a run of byte tokens is held until the run ends."""

    def __init__(self, tokenizer: SentencePieceBPETokenizer) -> None:
        super().__init__(tokenizer)
        self._run: list[int] = []

    def push(self, token_id: int) -> str:
        tok = self.tokenizer
        assert isinstance(tok, SentencePieceBPETokenizer)
        if tok._is_byte_token(token_id):
            self._run.append(token_id)
            return ""
        return self.flush() + tok.token_bytes(token_id).decode("utf-8", errors="replace")

    def flush(self) -> str:
        tok = self.tokenizer
        assert isinstance(tok, SentencePieceBPETokenizer)
        text, self._run = (tok._byte_run_text(self._run) if self._run else ""), []
        return text


_BYTE_PIECE = regex.compile(r"<0x([0-9A-Fa-f]{2})>")


def _is_byte_piece(name: str) -> bool:
    """Whether ``name`` is the token byte fallback spells a byte with: "<0x" two upper-case hex digits ">"."""
    m = _BYTE_PIECE.fullmatch(name)
    return m is not None and name == f"<0x{int(m.group(1), 16):02X}>"


_MARK_INSIDE = regex.compile(f"[^{SPACE_MARK}]{SPACE_MARK}")
# words: a run of "▁" and what follows it up to the next "▁" after another character
_WORDS = regex.compile(f"{SPACE_MARK}*[^{SPACE_MARK}]*")
_WORDS_SPLIT = regex.compile(f"{SPACE_MARK}?[^{SPACE_MARK}]*")


__all__ = ["ByteLevelBPETokenizer", "SentencePieceBPETokenizer", "ImportedTokenizer", "PATTERNS", "SPACE_MARK",
           "checked_vocab_size"]
