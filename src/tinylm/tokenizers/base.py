"""The interface every tinylm tokenizer shares, and the versioned JSON file they are saved in.

A tokenizer maps text to a list of token ids from a vocabulary V and back. Every tokenizer's
vocabulary has two parts, in this order:

1. the *base* vocabulary, which is what the tokenizer itself learned or was built with
   (characters, words, or the 256 bytes followed by the BPE merges), and
2. the *special* tokens, with ids right after the base vocabulary: ``<|bos|>`` (the fixed
   beginning-of-sequence token x_0 every sequence starts from), ``<|eos|>`` (ends a document; a model
   learns to stop by predicting it), ``<|pad|>`` (fills short sequences; masked out of attention
   and loss), then a reserved range ``<|reserved_0|>``, ``<|reserved_1|>``, ... kept free for
   later use (chat markers, fine-tuning tags) without resizing the model.

Every token has a byte string (`token_bytes`), and decoding always goes through bytes: this is
what lets a byte-level tokenizer end a token in the middle of a multi-byte character and still
decode correctly once the rest arrives (see `StreamDecoder`).

Special-token text inside user input is plain text unless the caller allows it: by default
``encode("<|eos|>")`` tokenizes the seven characters, so a document cannot inject an EOS.

Usage::

    tok = CharTokenizer.train(text)
    ids = tok.encode("hello")
    assert tok.decode(ids) == "hello"
    tok.save("tok.json")
    tok = load_tokenizer("tok.json")
"""

from __future__ import annotations

import codecs
import hashlib
import json
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal

import regex

from tinylm.atomic import atomic_write_text
from tinylm.errors import TinyLMError
from tinylm.jsonfile import JSONFormat

TOKENIZER_FILE = JSONFormat(
    "tinylm.tokenizer", 1,
    missing="tokenizer file {path} does not exist; train one with `tinylm tokenizer train`",
    unreadable="cannot read tokenizer file {path}: {error}",
    corrupt="tokenizer file {path} is corrupt (invalid JSON at line {line}, column {column}); "
            "re-create it with `tinylm tokenizer train`",
    foreign='{path} is not a tinylm tokenizer file (no "format": "{name}"); '
            "to read a Hugging Face tokenizer.json or a .tiktoken file use `tinylm tokenizer import`",
    wrong_version="tokenizer file {path} has format version {found!r}, but this tinylm reads version {version}; "
                  "upgrade tinylm or re-train the tokenizer",
)
FORMAT_NAME = TOKENIZER_FILE.name

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
# ChatML's turn markers: what tinylm adds for chats (every tool that reads chats knows them)
CHAT_START, CHAT_END = "<|im_start|>", "<|im_end|>"
ROLES = ("bos", "eos", "pad")


# More reserved tokens than any model family uses (Llama 3 reserves 256), few enough that a
# hand-edited "n_reserved": 1000000000 is an error, not a billion strings.
MAX_RESERVED = 1 << 16


def special_token_names(n_reserved: int = 0) -> list[str]:
    """The special tokens in id order: bos, eos, pad, then ``n_reserved`` reserved ones."""
    if isinstance(n_reserved, bool) or not isinstance(n_reserved, int):
        raise TinyLMError(f"the reserved range must be a whole number of tokens, got {n_reserved!r}")
    if not 0 <= n_reserved <= MAX_RESERVED:
        raise TinyLMError(f"the reserved range must be 0 to {MAX_RESERVED:,} tokens, got {n_reserved:,}")
    return [BOS, EOS, PAD] + [f"<|reserved_{i}|>" for i in range(n_reserved)]


AllowedSpecial = Literal["all"] | Iterable[str]


def without_lone_surrogates(text: str) -> str:
    """``text`` as UTF-8 can hold it: a surrogate pair becomes its character, a lone surrogate U+FFFD.

    A Python string (from JSON's "\\ud800", or a file read with surrogateescape) may hold
    surrogate code points, which have no UTF-8 form. Every tinylm encoder treats them this way,
    as tiktoken does, so no encoder raises on them and all give the same ids.
    """
    if text.isascii():
        return text
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


# kind (as written in the JSON file) -> class: every concrete tokenizer class adds itself when it is defined
# (`Tokenizer.__init_subclass__`), and importing any tinylm.tokenizers module imports them all first
KINDS: dict[str, type[Tokenizer]] = {}


class Tokenizer(ABC):
    """Text <-> token ids. Subclasses implement the base vocabulary; this class adds the rest.

    Subclasses must set `kind` and implement `base_vocab_size`, `encode_ordinary`,
    `_base_token_bytes`, `_to_dict` and `_from_dict`.
    """

    kind: ClassVar[str]
    # a model tuned on conversations reads them through a Jinja chat template (`tinylm.tokenizers.chat_template`);
    # tinylm's own tokenizers get one, and the special tokens it writes, with `with_chat_tokens`
    chat_template: str | None = None
    chat_tokens: tuple[str, ...] = ()  # the special tokens added for chats, after every other id

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "kind" in cls.__dict__:
            KINDS[cls.kind] = cls

    def __init__(self, n_reserved: int = 0) -> None:
        names = special_token_names(n_reserved)
        self.n_reserved = n_reserved
        self._set_specials({name: self.base_vocab_size + i for i, name in enumerate(names)},
                           {"bos": BOS, "eos": EOS, "pad": PAD})

    def _set_specials(self, specials: dict[str, int], roles: dict[str, str]) -> None:
        """The special tokens (name -> id) and which of them plays each role (bos, eos, pad -> a name).

        tinylm's own tokenizers put theirs right after the base vocabulary; an imported tokenizer
        (`tinylm.tokenizers.imported`) keeps its author's ids and names, wherever they are.
        """
        missing = [role for role in ROLES if roles.get(role) not in specials]
        if missing:
            raise TinyLMError(f"no special token plays the role of {', '.join(missing)} (roles {roles}, "
                              f"special tokens {sorted(specials)[:8]})")
        self.special_tokens: dict[str, int] = dict(specials)
        self.roles = {role: roles[role] for role in ROLES}
        self._special_bytes = {i: name.encode("utf-8") for name, i in self.special_tokens.items()}

    def _add_chat_tokens(self, names: Sequence[str], template: str) -> None:
        """Add the special tokens ``names`` with the next free ids, and the chat template that writes them."""
        if not names or len(set(names)) != len(names) or any(not isinstance(n, str) or not n for n in names):
            raise TinyLMError(f"chat tokens must be distinct non-empty names, got {list(names)!r}")
        taken = [name for name in names if name in self.special_tokens]
        if taken:
            raise TinyLMError(f"the tokenizer already has the special tokens {taken}")
        if not isinstance(template, str) or not template:
            raise TinyLMError("a chat template must be a non-empty Jinja text")
        start = self.vocab_size
        self._set_specials({**self.special_tokens, **{name: start + i for i, name in enumerate(names)}}, self.roles)
        self.chat_tokens = (*self.chat_tokens, *names)
        self.chat_template = template

    # ----- the vocabulary -------------------------------------------------------------------

    @property
    @abstractmethod
    def base_vocab_size(self) -> int:
        """Number of ids before the special tokens."""

    @property
    def vocab_size(self) -> int:
        """|V|: every id this tokenizer can produce, special tokens included."""
        return self.base_vocab_size + len(self.special_tokens)

    @property
    def bos_id(self) -> int:
        return self.special_tokens[self.roles["bos"]]

    @property
    def eos_id(self) -> int:
        return self.special_tokens[self.roles["eos"]]

    @property
    def pad_id(self) -> int:
        return self.special_tokens[self.roles["pad"]]

    # Whether a document starts with BOS in the tokenizer's own pipeline (Llama's does: "<s>" first).
    # tinylm's own tokenizers leave the start token to `tinylm.run.start_ids`.
    add_bos: bool = False

    def pipeline_start_ids(self) -> list[int] | None:
        """The ids this tokenizer's own pipeline puts before every text (an imported tokenizer's post-processor:
        its BOS, or nothing); None for tinylm's own tokenizers, whose start token the run decides."""
        return None

    def is_special(self, token_id: int) -> bool:
        """A special token (or an id no token uses): no text, never counted as bytes, not sampled as text."""
        return token_id in self._special_bytes

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes that token stands for (a special token stands for its own name)."""
        if not 0 <= token_id < self.vocab_size:
            raise TinyLMError(
                f"token id {token_id} is outside this tokenizer's vocabulary 0..{self.vocab_size - 1}"
            )
        special = self._special_bytes.get(token_id)
        if special is not None:
            return special
        return self._base_token_bytes(token_id)

    @abstractmethod
    def _base_token_bytes(self, token_id: int) -> bytes: ...

    # ----- encoding -------------------------------------------------------------------------

    @abstractmethod
    def encode_ordinary(self, text: str) -> list[int]:
        """Encode text with every special token's text treated as plain text."""

    def encode(self, text: str, *, allowed_special: AllowedSpecial = ()) -> list[int]:
        """Encode text. Special-token names in ``text`` become special ids only if allowed.

        ``allowed_special`` is ``"all"`` or an iterable of special token names such as
        ``{"<|eos|>"}``; everything else is encoded as ordinary text.
        """
        return self._encode_with_specials(text, self._allowed(allowed_special), self.encode_ordinary)

    def _encode_with_specials(
        self, text: str, allowed: set[str], encode_ordinary: Callable[[str], list[int]]
    ) -> list[int]:
        """Cut out the allowed special tokens' text; encode the rest with ``encode_ordinary``."""
        if not allowed:
            return encode_ordinary(text)
        ids: list[int] = []
        for i, piece in enumerate(self._split_specials(text, allowed)):
            if i % 2:
                ids.append(self.special_tokens[piece])
            elif piece:
                ids.extend(encode_ordinary(piece))
        return ids

    @staticmethod
    def _split_specials(text: str, allowed: set[str]) -> list[str]:
        """``text`` cut around the allowed special tokens' names: even pieces are text, odd ones the specials
        (the split pattern is one capture group; the longest name is tried first)."""
        pattern = "(" + "|".join(regex.escape(name) for name in sorted(allowed, key=len, reverse=True)) + ")"
        return regex.split(pattern, text)

    def _allowed(self, allowed_special: AllowedSpecial) -> set[str]:
        if allowed_special == "all":
            return set(self.special_tokens)
        allowed = set(allowed_special)
        unknown = allowed - set(self.special_tokens)
        if unknown:
            raise TinyLMError(
                f"unknown special token(s) {sorted(unknown)}; this tokenizer has {list(self.special_tokens)}"
            )
        return allowed

    def encode_batch(
        self, texts: Sequence[str], *, allowed_special: AllowedSpecial = ()
    ) -> list[list[int]]:
        """Encode many texts; subclasses with a native batch path override this."""
        return [self.encode(t, allowed_special=allowed_special) for t in texts]

    # ----- decoding -------------------------------------------------------------------------

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        return b"".join(self.token_bytes(int(i)) for i in ids)

    def decode(self, ids: Iterable[int], errors: str = "replace") -> str:
        """Decode ids to text through their bytes; invalid UTF-8 becomes U+FFFD by default."""
        return self.decode_bytes(ids).decode("utf-8", errors=errors)

    def stream_decoder(self) -> StreamDecoder:
        return StreamDecoder(self)

    def pieces(self, text: str, *, allowed_special: AllowedSpecial = ()) -> list[tuple[int, bytes]]:
        """How a text splits into tokens: (id, bytes) pairs, for showing to a person."""
        return [(i, self.token_bytes(i)) for i in self.encode(text, allowed_special=allowed_special)]

    # ----- saving and loading ---------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            **TOKENIZER_FILE.header(),
            "kind": self.kind,
            "n_reserved": self.n_reserved,
            "special_tokens": self.special_tokens,
            **self._to_dict(),
            # only when there are chat tokens: the files and fingerprints of other tokenizers stay as they were
            **({"chat": {"tokens": list(self.chat_tokens), "template": self.chat_template}} if self.chat_tokens else {}),
        }

    @abstractmethod
    def _to_dict(self) -> dict[str, Any]: ...

    @classmethod
    @abstractmethod
    def _from_dict(cls, data: dict[str, Any]) -> Tokenizer: ...

    def save(self, path: str | os.PathLike) -> Path:
        """Write the tokenizer as JSON, atomically (a crash never leaves a half-written file)."""
        return atomic_write_text(path, json.dumps(self.to_dict(), ensure_ascii=False, indent=1) + "\n")

    def fingerprint(self) -> str:
        """A short hash of everything that decides the ids: equal fingerprints, equal encodings."""
        canonical = json.dumps(self.to_dict(), sort_keys=True, ensure_ascii=True)
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size})"


class StreamDecoder:
    """Turns token ids into text as they arrive, never splitting a multi-byte character.

    A byte-level tokenizer may end a token in the middle of a UTF-8 sequence (an emoji is four
    bytes and may be two tokens); the incomplete bytes are held back until they complete.
    `flush` returns whatever is left at the end (invalid bytes become U+FFFD).
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        return self._decoder.decode(self.tokenizer.token_bytes(token_id))

    def push_many(self, ids: Iterable[int]) -> Iterator[str]:
        for i in ids:
            piece = self.push(i)
            if piece:
                yield piece

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)


def tokenizer_from_dict(data: dict[str, Any], source: str = "<dict>") -> Tokenizer:
    """Rebuild a tokenizer from `Tokenizer.to_dict()` output."""
    kind = data.get("kind")
    if kind not in KINDS:
        raise TinyLMError(f"tokenizer file {source} has unknown kind {kind!r}; expected one of {sorted(KINDS)}")
    try:
        tok = KINDS[kind]._from_dict(data)
        if data.get("chat") is not None:
            tok._add_chat_tokens(data["chat"]["tokens"], data["chat"]["template"])
    except (KeyError, TypeError, ValueError, IndexError, TinyLMError) as e:
        what = str(e) if isinstance(e, TinyLMError) else f"{type(e).__name__}: {e}"
        raise TinyLMError(
            f"tokenizer file {source} is corrupt ({what}); re-create it with `tinylm tokenizer train`"
        ) from None
    if tok.special_tokens != data.get("special_tokens"):
        raise TinyLMError(f"tokenizer file {source} is corrupt: its special token ids do not match its vocabulary")
    return tok


class TokenizerMismatch(TinyLMError):
    """Two things whose token ids must mean the same text were made with different tokenizers."""


def check_same_tokenizer(made_with: Tokenizer | str, tokenizer: Tokenizer, what: str, fix: str) -> None:
    """Refuse ``what`` (ids made with ``made_with``, a tokenizer or its fingerprint) unless ``tokenizer`` is
    that tokenizer: ids mean text only under the tokenizer that made them, and the same fingerprint is the
    same encoding. Every such refusal reads "<what> (fingerprints A and B); <fix>"."""
    theirs = made_with if isinstance(made_with, str) else made_with.fingerprint()
    ours = tokenizer.fingerprint()
    if theirs != ours:
        raise TokenizerMismatch(f"{what} (fingerprints {theirs} and {ours}); {fix}")


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """Load any tinylm tokenizer saved with `Tokenizer.save`."""
    path = Path(path)
    return tokenizer_from_dict(TOKENIZER_FILE.read(path), str(path))


def whole_number(value: Any, what: str) -> int:
    """``value`` if it is an int (not a bool, not 1.5, not "1"): what a file must hold where an id or a count goes."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{what} must be a whole number, got {value!r}")
    return value


def default_stop_ids(tokenizer: Tokenizer | None) -> set[int]:
    """The ids that end a generation unless the caller gives others: EOS, and an imported tokenizer's
    ``stop_ids`` (the end-of-turn tokens of a chat model: Llama 3's ``<|eot_id|>``, ChatML's ``<|im_end|>``,
    `tinylm.tokenizers.imported`). None (no tokenizer): none."""
    if tokenizer is None:
        return set()
    turn_end = [tokenizer.special_tokens[CHAT_END]] if CHAT_END in tokenizer.chat_tokens else []
    return {tokenizer.eos_id, *getattr(tokenizer, "stop_ids", ()), *turn_end}


def generation_excluded(tokenizer: Tokenizer) -> list[int]:
    """The ids no model may generate as text: every special token that does not end a generation (padding, BOS,
    reserved ids, a chat model's turn headers; EOS and the other `default_stop_ids` may be drawn) and ``<unk>``,
    which stands for text the tokenizer cannot spell. A barely trained network (or an n-gram model's smoothing)
    gives them some probability; sampling, beam search and the server leave them out."""
    unk = getattr(tokenizer, "unk_id", None)
    stop = default_stop_ids(tokenizer)
    return [i for i in range(tokenizer.vocab_size) if (tokenizer.is_special(i) and i not in stop) or i == unk]
