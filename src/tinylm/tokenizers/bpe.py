"""Byte-level BPE: the 256 bytes, then merges learned from text, applied lowest rank first.

Merge r makes token 256 + r, and merges never cross a chunk of the split pattern (GPT-2's or
GPT-4's). Two encoders give the same ids: `encode_reference`, the definition written to be read,
and `encode` / `encode_ordinary`, the same rule run by tiktoken's Rust core on our own ranks (a
third path, `merge_long_chunk`, takes over for whitespace runs long enough to break tiktoken).
Training is `tinylm.tokenizers.bpe_train`. docs/tokenizers.md says why the encoders agree and
where they could not.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy as np
import regex
import tiktoken

from tinylm.errors import TinyLMError
from tinylm.tokenizers.base import AllowedSpecial, Tokenizer, whole_number, without_lone_surrogates

# The split patterns of GPT-2 (r50k) and GPT-4 (cl100k), as tiktoken writes them (possessive
# quantifiers, same chunks as the originals). "none" means no pre-tokenization: the whole text
# is one chunk and merges may cross spaces.
PATTERNS: dict[str, str] = {
    "gpt2": r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s""",
    "gpt4": r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|\s*[\r\n]|\s+(?!\S)|\s""",
    "none": r"""[\s\S]+""",
}


def resolve_pattern(pattern: str) -> str:
    """A pattern name (gpt2, gpt4, none) or a regex of the user's own, checked to compile."""
    if pattern in PATTERNS:
        return PATTERNS[pattern]
    try:
        compiled = regex.compile(pattern)
    except regex.error as e:
        raise TinyLMError(
            f"split pattern {pattern!r} is neither a known name ({', '.join(PATTERNS)}) nor a valid regex: {e}"
        ) from None
    # Text the pattern does not match is silently dropped by a findall-style split, and an
    # empty match makes tiktoken panic; refuse both up front (end the pattern with `|\s|.`).
    if compiled.fullmatch(""):
        raise TinyLMError(f"split pattern {pattern!r} can match empty text; make every branch match at least one character")
    if "".join(compiled.findall(_PATTERN_PROBE)) != _PATTERN_PROBE:
        raise TinyLMError(
            f"split pattern {pattern!r} does not cover every character, so text would be lost; "
            r"add a catch-all branch such as `|\s+|[^\s]`"
        )
    return pattern


# Text with a whitespace run this long is split by the `regex` module, not by tiktoken (see the module
# docstring). tiktoken's engine gives up near a million characters; this leaves a wide margin, and
# below it tiktoken's own merge is as fast as the vectorised one.
LONG_RUN = 16_384


@functools.lru_cache(maxsize=8)
def _long_whitespace(min_length: int) -> regex.Pattern:
    # (?<!\s): try only where a run starts, or a run just under min_length would be rescanned from
    # each of its characters
    return regex.compile(r"(?<!\s)\s{%d}" % min_length)


_WHITESPACE = regex.compile(r"\s")


# A probe for custom split patterns: letters, digits, punctuation, whitespace runs, CRLF,
# accents, CJK and an emoji.
_PATTERN_PROBE = "Hello,  world!\r\n\tIt's 2024... naïve e\u0301 中文 😀 $x_1+y=3\n\n"


def pattern_name(pattern: str) -> str | None:
    for name, pat in PATTERNS.items():
        if pat == pattern:
            return name
    return None


class TiktokenPath:
    """Encoding through a tiktoken `Encoding` (token bytes -> id), with the long-whitespace path beside it.

    Shared by `BPETokenizer` and the imported byte-level BPE (`tinylm.tokenizers.imported`). A class
    using it sets ``pattern``, ``_split`` (the compiled pattern), ``tiktoken_encoding``,
    ``_id_bytes`` (each id's bytes), ``_token_ids`` (the inverse, for the tokens BPE may produce) and
    ``_byte_ids`` (the id of each single byte, or None for byte b = id b), and has ``_allowed``.
    """

    pattern: str
    _split: regex.Pattern
    tiktoken_encoding: tiktoken.Encoding
    _id_bytes: Sequence[bytes]
    _token_ids: dict[bytes, int]
    _byte_ids: np.ndarray | None = None
    _allowed: Any
    _encode_with_specials: Any

    # ----- the fast path --------------------------------------------------------------------

    def encode_ordinary(self, text: str) -> list[int]:
        text = without_lone_surrogates(text)
        if self._has_long_run(text):
            return self._encode_long_text(text)
        return _tiktoken_call(self.tiktoken_encoding.encode_ordinary, text)

    def encode(self, text: str, *, allowed_special: AllowedSpecial = ()) -> list[int]:
        allowed = self._allowed(allowed_special)
        text = without_lone_surrogates(text)
        if self._has_long_run(text):
            return self._encode_with_specials(text, allowed, self._encode_long_text)
        # disallowed_special=() : special-token text the caller did not allow is plain text
        return _tiktoken_call(self.tiktoken_encoding.encode, text, allowed_special=allowed, disallowed_special=())

    def encode_batch(
        self, texts: Sequence[str], *, allowed_special: AllowedSpecial = (), num_threads: int = 8
    ) -> list[list[int]]:
        allowed = self._allowed(allowed_special)
        texts = [without_lone_surrogates(t) for t in texts]
        long = [self._has_long_run(t) for t in texts]
        if any(long):
            return [self._encode_with_specials(t, allowed, self._encode_long_text) if is_long else
                    _tiktoken_call(self.tiktoken_encoding.encode, t, allowed_special=allowed, disallowed_special=())
                    for t, is_long in zip(texts, long)]
        return _tiktoken_call(
            self.tiktoken_encoding.encode_batch,
            texts, num_threads=num_threads, allowed_special=allowed, disallowed_special=(),
        )

    # ----- text with very long whitespace runs (see the module docstring) ---------------------

    long_run = LONG_RUN  # a class attribute, so a test can lower it and reach this path with short text

    def _has_long_run(self, text: str) -> bool:
        n = self.long_run
        if len(text) < n:
            return False
        # Any run of n characters covers a multiple of n, so look only around those that are
        # spaces (str.isspace accepts every character \s does): ordinary text costs almost nothing.
        # The window around position p holds n characters of any long run through p (a slice, not
        # search(pos=...), so that the look-behind sees the window's start as the text's start).
        return any(
            c.isspace() and _long_whitespace(n).search(text[max(0, p - n):p + n]) is not None
            for p, c in zip(range(0, len(text), n), text[::n])
        )

    def _encode_long_text(self, text: str) -> list[int]:
        """`encode_ordinary` for text with a long whitespace run: the same ids, in linear time.

        The `regex` module finds the chunks. The text between two long whitespace chunks goes
        to tiktoken in one call: it starts and ends where chunks start and end, and since what
        followed it was whitespace, the built-in patterns (whose only look-arounds are "no
        non-space follows" and the end of the text) cut it there again. A pattern of the user's
        own might not, so there every chunk is encoded on its own.
        """
        enc = self.tiktoken_encoding
        ids: list[int] = []
        if pattern_name(self.pattern) is None:
            for chunk in self._split.findall(text):
                ids.extend(self._encode_chunk(chunk))
            return ids
        done = 0  # text[:done] is encoded
        for m in self._split.finditer(text):
            start, end = m.span()
            if end - start >= self.long_run and _WHITESPACE.match(text, start):
                if start > done:
                    ids.extend(_tiktoken_call(enc.encode_ordinary, text[done:start]))
                ids.extend(self._encode_chunk(m.group()))
                done = end
        if done < len(text):
            ids.extend(_tiktoken_call(enc.encode_ordinary, text[done:]))
        return ids

    def _encode_chunk(self, chunk: str) -> list[int]:
        data = chunk.encode("utf-8")
        if len(data) >= self.long_run:
            ids = merge_long_chunk(data, self._id_bytes, self._token_ids, self._byte_ids)
            if ids is not None:
                return ids
        return _tiktoken_call(self.tiktoken_encoding._core_bpe.encode_single_piece, data)


class BPETokenizer(TiktokenPath, Tokenizer):
    """Byte-level BPE with a pre-tokenization pattern and special tokens after the merges."""

    kind = "bpe"

    def __init__(
        self,
        merges: Sequence[tuple[int, int]],
        pattern: str = "gpt4",
        n_reserved: int = 0,
    ) -> None:
        self.pattern = resolve_pattern(pattern)
        self.merges: list[tuple[int, int]] = [(int(a), int(b)) for a, b in merges]
        self.ranks: dict[tuple[int, int], int] = {}  # pair -> rank (the new token is 256 + rank)
        self.vocab: list[bytes] = [bytes([b]) for b in range(256)]
        for rank, (a, b) in enumerate(self.merges):
            new_id = 256 + rank
            if not (0 <= a < new_id and 0 <= b < new_id):
                raise ValueError(f"merge {rank} ({a}, {b}) refers to a token that does not exist yet")
            if (a, b) in self.ranks:
                raise ValueError(f"merge {rank} ({a}, {b}) repeats merge {self.ranks[a, b]}")
            self.ranks[a, b] = rank
            self.vocab.append(self.vocab[a] + self.vocab[b])
        if len(set(self.vocab)) != len(self.vocab):
            raise ValueError("two merges produce the same bytes; tinylm's BPE needs every token's bytes unique")
        self._split = regex.compile(self.pattern)
        super().__init__(n_reserved)

    @property
    def base_vocab_size(self) -> int:
        return len(self.vocab)

    def _base_token_bytes(self, token_id: int) -> bytes:
        return self.vocab[token_id]

    # ----- the reference encoder ------------------------------------------------------------

    def encode_reference(self, text: str, *, allowed_special: AllowedSpecial = ()) -> list[int]:
        """The readable encoder: the same ids as `encode`, computed by the definition (lowest-rank merge first)."""
        return self._encode_with_specials(text, self._allowed(allowed_special), self._encode_reference_ordinary)

    def _encode_reference_ordinary(self, text: str) -> list[int]:
        ids: list[int] = []
        for chunk in self._split.findall(without_lone_surrogates(text)):
            ids.extend(self._merge_chunk(list(chunk.encode("utf-8"))))
        return ids

    def _merge_chunk(self, ids: list[int]) -> list[int]:
        inf = len(self.ranks)
        while len(ids) >= 2:
            # the adjacent pair whose merge was learned earliest (lowest rank)
            pair = min(zip(ids, ids[1:]), key=lambda p: self.ranks.get(p, inf))
            rank = self.ranks.get(pair)
            if rank is None:
                break  # no adjacent pair has a merge: the chunk is fully encoded
            ids = _replace_pair(ids, pair, 256 + rank)
        return ids

    @functools.cached_property
    def tiktoken_encoding(self) -> tiktoken.Encoding:
        """Our ranks as a tiktoken Encoding: token bytes -> id, specials after the merges."""
        return tiktoken.Encoding(
            name=f"tinylm-bpe-{len(self.merges)}",
            pat_str=self.pattern,
            mergeable_ranks={b: i for i, b in enumerate(self.vocab)},
            special_tokens=dict(self.special_tokens),
            explicit_n_vocab=self.vocab_size,
        )

    @property
    def _id_bytes(self) -> Sequence[bytes]:
        return self.vocab

    @functools.cached_property
    def _token_ids(self) -> dict[bytes, int]:
        return {b: i for i, b in enumerate(self.vocab)}

    # ----- saving ---------------------------------------------------------------------------

    def _to_dict(self) -> dict[str, Any]:
        name = pattern_name(self.pattern)
        return {"pattern": name if name else self.pattern, "merges": [list(m) for m in self.merges]}

    @classmethod
    def _from_dict(cls, data: dict[str, Any]) -> BPETokenizer:
        merges = []
        for rank, m in enumerate(data["merges"]):
            if not isinstance(m, list) or len(m) != 2:
                raise ValueError(f"merge {rank} must be a pair of token ids, got {m!r}")
            merges.append((whole_number(m[0], f"merge {rank}'s ids"), whole_number(m[1], f"merge {rank}'s ids")))
        if not isinstance(data["pattern"], str):
            raise ValueError(f"the split pattern must be text, got {data['pattern']!r}")
        return cls(merges, pattern=data["pattern"], n_reserved=whole_number(data["n_reserved"], "n_reserved"))


def _tiktoken_call(fn, *args: Any, **kwargs: Any) -> Any:
    """Call into tiktoken; a Rust panic (pyo3's PanicException, a BaseException) becomes a TinyLMError."""
    try:
        return fn(*args, **kwargs)
    except (KeyboardInterrupt, SystemExit, MemoryError):
        raise
    except BaseException as e:
        if type(e).__name__ != "PanicException":
            raise
        raise TinyLMError(f"tiktoken failed on this text ({str(e).splitlines()[0] if str(e) else 'a panic'}); "
                          "please report it with the text that caused it") from None


# A long chunk with more distinct tokens than this is merged by tiktoken instead: the pair table
# of `merge_long_chunk` is this squared.
_MAX_DISTINCT = 512


def merge_long_chunk(data: bytes, vocab: Sequence[bytes], token_ids: dict[bytes, int],
                     byte_ids: np.ndarray | None = None) -> list[int] | None:
    """BPE of one chunk, vectorised: the reference's rule, each pass a few numpy operations.

    Each pass finds the adjacent pair whose concatenated bytes are the lowest-ranked token (the
    rank tiktoken uses) and merges all its occurrences, left to right. For a long run of spaces a
    pass halves the array, so the whole chunk costs a few times its length. Returns None (let
    tiktoken merge) when the chunk holds too many distinct tokens for the pair table, or when a
    pass would make a pair of lower rank than the one just merged: merging every occurrence at
    once equals tiktoken's one-at-a-time order only while ranks rise, which they do for every
    tokenizer tinylm trains. ``vocab`` is each id's bytes, ``token_ids`` its inverse, ``byte_ids`` (256,)
    the id of each single byte (byte b is id b when it is None, as in tinylm's own layout).
    """
    ids = np.frombuffer(data, dtype=np.uint8).astype(np.int64)
    if byte_ids is not None:
        ids = byte_ids[ids]
    last_rank = -1
    while len(ids) >= 2:
        present = np.flatnonzero(np.bincount(ids))  # (P,) the distinct tokens, sorted
        p = len(present)
        if p > _MAX_DISTINCT:
            return None
        local = np.zeros(int(present[-1]) + 1, dtype=np.int64)
        local[present] = np.arange(p)
        local = local[ids]  # (n,) each token's index in present
        seen = np.bincount(local[:-1] * p + local[1:], minlength=p * p)
        best_rank, best = None, None
        for k in np.flatnonzero(seen):
            a, b = int(present[k // p]), int(present[k % p])
            rank = token_ids.get(vocab[a] + vocab[b])
            if rank is not None and (best_rank is None or rank < best_rank):
                best_rank, best = rank, (a, b)
        if best is None:
            break
        if best_rank < last_rank:
            return None
        last_rank = best_rank
        a, b = best
        starts = (ids[:-1] == a) & (ids[1:] == b)  # (n-1,) where the pair begins
        if a == b:
            # in a run of a's the pairs are taken left to right: keep the starts at an even
            # distance from the run's first a
            is_a = ids == a
            index = np.arange(len(ids))
            run_start = np.maximum.accumulate(np.where(is_a & ~np.r_[False, is_a[:-1]], index, 0))
            starts &= ((index - run_start)[:-1] % 2) == 0
        pos = np.flatnonzero(starts)
        ids[pos] = best_rank
        ids = np.delete(ids, pos + 1)
    return ids.tolist()


def _replace_pair(ids: list[int], pair: tuple[int, int], new_id: int) -> list[int]:
    """Replace every non-overlapping occurrence of ``pair``, left to right, by ``new_id``."""
    out: list[int] = []
    i = 0
    while i < len(ids):
        if i + 1 < len(ids) and ids[i] == pair[0] and ids[i + 1] == pair[1]:
            out.append(new_id)
            i += 2
        else:
            out.append(ids[i])
            i += 1
    return out
