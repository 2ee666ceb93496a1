"""Character-level and word-level tokenizers: a vocabulary of whole pieces of text.

Both split text into pieces (single characters, or words / numbers / punctuation / whitespace
runs) and give each known piece an id. They differ only in how they split and in which pieces
they keep when trained:

- `CharTokenizer`: every character seen in the training text, sorted by code point (the
  nanoGPT Shakespeare-char vocabulary).
- `WordTokenizer`: the most frequent words, ties broken by the word itself so training is
  deterministic. Splitting keeps whitespace and punctuation as pieces of their own, so the
  pieces concatenate back to the text exactly.

Policy for input the vocabulary has never seen, chosen when the tokenizer is built:

- ``unknown="unk"`` (the default): an unseen piece becomes the ``<unk>`` token (id 0), which
  decodes to U+FFFD for characters and to the text ``<unk>`` for words. Round trips hold for
  text made of known pieces only.
- ``unknown="bytes"``: 256 byte tokens follow the pieces, and an unseen piece is spelled as
  its UTF-8 bytes (SentencePiece's "byte fallback"). Every string then round-trips.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any, ClassVar

import regex

from tinylm.errors import TinyLMError
from tinylm.tokenizers.base import Tokenizer, special_token_names, whole_number, without_lone_surrogates

UNKNOWN_POLICIES = ("unk", "bytes")

# A word is letters (with combining marks and inner apostrophes: "blush'd", "to't"); then
# numbers, runs of whitespace, and any other single character. `(?s).` catches everything
# else, so the pieces always concatenate back to the input.
WORD_PATTERN = r"\p{L}[\p{L}\p{M}]*(?:['’][\p{L}\p{M}]+)*|\p{N}+|\s+|(?s:.)"


def _as_texts(texts: str | Iterable[str]) -> Iterable[str]:
    return [texts] if isinstance(texts, str) else texts


class PieceTokenizer(Tokenizer):
    """A fixed list of pieces, looked up whole; subclasses say how text splits into pieces."""

    unk_text: ClassVar[str]

    def __init__(self, pieces: list[str], unknown: str = "unk", n_reserved: int = 0) -> None:
        if unknown not in UNKNOWN_POLICIES:
            raise TinyLMError(f"unknown-input policy must be one of {UNKNOWN_POLICIES}, got {unknown!r}")
        if len(set(pieces)) != len(pieces):
            raise TinyLMError("a tokenizer's pieces must be distinct")
        self.unknown = unknown
        self.pieces_list = list(pieces)
        # Layout: [<unk>] + pieces (unk policy) or pieces + 256 bytes (bytes policy).
        self._offset = 1 if unknown == "unk" else 0
        self._ids = {p: i + self._offset for i, p in enumerate(self.pieces_list)}
        self._bytes = [p.encode("utf-8") for p in self.pieces_list]
        self._byte_base = self._offset + len(self.pieces_list)  # first byte-fallback id
        super().__init__(n_reserved)

    @property
    def base_vocab_size(self) -> int:
        return self._byte_base + (256 if self.unknown == "bytes" else 0)

    @property
    def unk_id(self) -> int | None:
        return 0 if self.unknown == "unk" else None

    def split(self, text: str) -> list[str]:
        raise NotImplementedError

    def encode_ordinary(self, text: str) -> list[int]:
        ids: list[int] = []
        lookup = self._ids.get
        for piece in self.split(without_lone_surrogates(text)):
            i = lookup(piece)
            if i is not None:
                ids.append(i)
            elif self.unknown == "unk":
                ids.append(0)
            else:
                ids.extend(self._byte_base + b for b in piece.encode("utf-8"))
        return ids

    def _base_token_bytes(self, token_id: int) -> bytes:
        if token_id < self._offset:
            return self.unk_text.encode("utf-8")
        if token_id < self._byte_base:
            return self._bytes[token_id - self._offset]
        return bytes([token_id - self._byte_base])

    def _to_dict(self) -> dict[str, Any]:
        return {"unknown": self.unknown, "pieces": self.pieces_list}

    @classmethod
    def _from_dict(cls, data: dict[str, Any]) -> PieceTokenizer:
        pieces = data["pieces"]
        if not isinstance(pieces, list) or not all(isinstance(p, str) and p for p in pieces):
            raise ValueError("pieces must be a list of non-empty strings")
        return cls(pieces, unknown=data["unknown"], n_reserved=whole_number(data["n_reserved"], "n_reserved"))


class CharTokenizer(PieceTokenizer):
    """One token per Unicode character seen in training, sorted by code point."""

    kind = "char"
    unk_text = "\ufffd"

    def split(self, text: str) -> list[str]:
        return list(text)

    @classmethod
    def train(cls, texts: str | Iterable[str], unknown: str = "unk", n_reserved: int = 0) -> CharTokenizer:
        chars: set[str] = set()
        for text in _as_texts(texts):
            chars.update(text)
        if not chars:
            raise TinyLMError("cannot build a character vocabulary from empty text; give a corpus with some text in it")
        return cls(sorted(chars), unknown=unknown, n_reserved=n_reserved)


class WordTokenizer(PieceTokenizer):
    """The most frequent words, numbers, punctuation marks and whitespace runs."""

    kind = "word"
    unk_text = "<unk>"
    _split = regex.compile(WORD_PATTERN)

    def split(self, text: str) -> list[str]:
        return self._split.findall(text)

    @classmethod
    def train(
        cls,
        texts: str | Iterable[str],
        vocab_size: int,
        unknown: str = "unk",
        n_reserved: int = 0,
    ) -> WordTokenizer:
        """Keep the most frequent pieces so that |V| (specials included) is ``vocab_size``.

        Ties in frequency are broken by the piece's text, so the result is deterministic.
        """
        overhead = len(special_token_names(n_reserved)) + (1 if unknown == "unk" else 256)
        n_pieces = vocab_size - overhead
        if n_pieces < 1:
            raise TinyLMError(
                f"vocab size {vocab_size} leaves no room for words after {overhead} fixed tokens; "
                f"use a vocab size of at least {overhead + 1}"
            )
        counts: Counter[str] = Counter()
        for text in _as_texts(texts):
            counts.update(cls._split.findall(text))
        if not counts:
            raise TinyLMError("cannot build a word vocabulary from empty text; give a corpus with some text in it")
        ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:n_pieces]
        return cls([piece for piece, _ in ranked], unknown=unknown, n_reserved=n_reserved)
