"""Byte-level BPE: the 256 bytes, then merges learned from text, applied lowest rank first.

The vocabulary starts from the 256 single bytes (ids 0..255), so any byte sequence, and hence
any string, can be encoded. Training (see `tinylm.tokenizers.bpe_train`) repeatedly merges the
most frequent adjacent pair into a new token; merge number r creates token id 256 + r, and r is
that merge's *rank*. Before merging, text is cut into chunks by a pre-tokenization regex (the
GPT-2 or GPT-4 pattern), and merges never cross a chunk boundary: " dog" and "dog." stay
separate words.

Two encoders give the same ids:

- `encode_reference`: the definition, written to be read. Within a chunk, start from its
  bytes and, while some adjacent pair has a merge, merge every occurrence of the pair whose
  merge has the lowest rank.
- `encode_ordinary` / `encode`: the fast path. The merges become a tiktoken `Encoding`
  (built offline from our own ranks; nothing is downloaded), whose Rust core runs the same
  lowest-rank-first rule.

They agree because the trainer never creates two tokens with the same bytes: tiktoken ranks a
merge by the bytes it produces, the reference by the pair that produced them, and with unique
bytes the two orders are the same. One caveat: the reference (and the trainer) split with the
`regex` module, tiktoken with Rust's regex crate, and their Unicode tables are of different
ages. On every character assigned in Unicode 14 they agree (checked over all code points);
about 4,600 letters added since are letters to `regex` but not to tiktoken, so text using them
may split differently on the two paths.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from typing import Any

import regex
import tiktoken

from tinylm.errors import TinyLMError
from tinylm.tokenizers.base import AllowedSpecial, Tokenizer

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


# A probe for custom split patterns: letters, digits, punctuation, whitespace runs, CRLF,
# accents, CJK and an emoji.
_PATTERN_PROBE = "Hello,  world!\r\n\tIt's 2024... naïve e\u0301 中文 😀 $x_1+y=3\n\n"


def pattern_name(pattern: str) -> str | None:
    for name, pat in PATTERNS.items():
        if pat == pattern:
            return name
    return None


class BPETokenizer(Tokenizer):
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
        """The readable encoder: the same ids as `encode`, computed the way the notes say."""
        return self._encode_with_specials(text, self._allowed(allowed_special), self._encode_reference_ordinary)

    def _encode_reference_ordinary(self, text: str) -> list[int]:
        ids: list[int] = []
        for chunk in self._split.findall(text):
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

    # ----- the fast path --------------------------------------------------------------------

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

    def encode_ordinary(self, text: str) -> list[int]:
        return self.tiktoken_encoding.encode_ordinary(text)

    def encode(self, text: str, *, allowed_special: AllowedSpecial = ()) -> list[int]:
        allowed = self._allowed(allowed_special)
        # disallowed_special=() : special-token text the caller did not allow is plain text
        return self.tiktoken_encoding.encode(text, allowed_special=allowed, disallowed_special=())

    def encode_batch(
        self, texts: Sequence[str], *, allowed_special: AllowedSpecial = (), num_threads: int = 8
    ) -> list[list[int]]:
        allowed = self._allowed(allowed_special)
        return self.tiktoken_encoding.encode_batch(
            list(texts), num_threads=num_threads, allowed_special=allowed, disallowed_special=()
        )

    # ----- saving ---------------------------------------------------------------------------

    def _to_dict(self) -> dict[str, Any]:
        name = pattern_name(self.pattern)
        return {"pattern": name if name else self.pattern, "merges": [list(m) for m in self.merges]}

    @classmethod
    def _from_dict(cls, data: dict[str, Any]) -> BPETokenizer:
        return cls([tuple(m) for m in data["merges"]], pattern=data["pattern"], n_reserved=int(data["n_reserved"]))


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


def train_bpe(
    texts: Iterable[str],
    vocab_size: int,
    pattern: str = "gpt4",
    n_reserved: int = 0,
    **kwargs: Any,
) -> BPETokenizer:
    """Train a byte-level BPE tokenizer; see `tinylm.tokenizers.bpe_train.train_merges`."""
    from tinylm.tokenizers.bpe_train import train_merges

    merges = train_merges(texts, vocab_size=vocab_size, pattern=resolve_pattern(pattern), n_reserved=n_reserved, **kwargs)
    return BPETokenizer(merges, pattern=pattern, n_reserved=n_reserved)
