"""Import and export of tinylm's BPE tokenizers in the two file formats the ecosystem uses.

tiktoken ranks files (``.tiktoken``: ``base64(token bytes) rank`` per line, no merges, pattern or
specials; the merges are recovered from the ranks by `merges_from_ranks`) and Hugging Face
tokenizer.json (a ``Split`` + ``ByteLevel`` pre-tokenizer and a ``BPE`` model, with GPT-2's
byte-to-character stand-ins `BYTE_TO_UNICODE` and our regex rewritten for Oniguruma by
`oniguruma_pattern`). docs/tokenizers.md has the field table and the traps each test pins.

This module reads and writes tokenizer.json for all of tinylm: it writes tinylm's own BPE and
imported tokenizers (`to_hf_tokenizer_json`), reads the file (`read_hf_tokenizer_json`) and tinylm's
layout in it (`tokenizer_from_hf_json`), and checks the parts any reader takes out of one
(`hf_bpe_model`, `hf_entries`, `hf_pipeline`, ...); `tinylm.tokenizers.hf_files` builds
tokenizers from the layouts of other tools with them.

Usage (the entry points that pick the format are `tinylm.tokenizers.files`)::

    save_hf_tokenizer_json(tok, "out/tokenizer.json")
    save_tiktoken(tok, "tok.tiktoken")
    tok = load_tiktoken("tok.tiktoken", pattern="gpt4")
"""

from __future__ import annotations

import base64
import binascii
import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import regex

from tinylm.atomic import atomic_write_text
from tinylm.errors import TinyLMError
from tinylm.jsonfile import json_kind, read_json_object
from tinylm.tokenizers.base import BOS, CHAT_END, CHAT_START, EOS, PAD, Tokenizer, special_token_names
from tinylm.tokenizers.bpe import PATTERNS, BPETokenizer, pattern_name
from tinylm.tokenizers.chat_template import CHATML_TEMPLATE
from tinylm.tokenizers.imported import (
    SPACE_MARK,
    ByteLevelBPETokenizer,
    ImportedTokenizer,
    SentencePieceBPETokenizer,
    checked_vocab_size,
)

FORMATS = ("tinylm", "tiktoken", "hf")

# The file written when `export_tokenizer` is given a folder. tokenizer.json is the name
# `transformers` looks for; tinylm's own file gets another name so both fit in one folder.
DEFAULT_FILENAMES = {"tinylm": "tinylm_tokenizer.json", "tiktoken": "tokenizer.tiktoken", "hf": "tokenizer.json"}


def _read_text(path: Path, what: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise TinyLMError(f"{what} {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise TinyLMError(f"cannot read {what} {path}: {e}") from None


# ----- GPT-2's byte <-> printable character map ---------------------------------------------


def _byte_to_unicode_table() -> tuple[str, ...]:
    """GPT-2's stand-in character for each byte, from its definition.

    Bytes that are already visible, unambiguous Latin-1 characters ('!'..'~', '¡'..'¬',
    '®'..'ÿ') stand for themselves. The other 68 (control characters, the space, DEL, the
    C1 controls, the no-break space and the soft hyphen) take the code points 256, 257, ...
    in byte order, so every byte gets one printable character and none is whitespace.
    """
    keep = set(range(ord("!"), ord("~") + 1)) | set(range(ord("¡"), ord("¬") + 1)) | set(range(ord("®"), 256))
    table: list[str] = []
    next_free = 256
    for b in range(256):
        if b in keep:
            table.append(chr(b))
        else:
            table.append(chr(next_free))
            next_free += 1
    return tuple(table)


BYTE_TO_UNICODE: tuple[str, ...] = _byte_to_unicode_table()
UNICODE_TO_BYTE: dict[str, int] = {ch: b for b, ch in enumerate(BYTE_TO_UNICODE)}
# str.translate tables: decoding bytes as Latin-1 gives chr(b) for each byte b, which the
# first table maps to its stand-in; the second undoes it before encoding back to Latin-1.
_TO_STAND_IN = {b: ch for b, ch in enumerate(BYTE_TO_UNICODE)}
_FROM_STAND_IN = {ord(ch): b for b, ch in enumerate(BYTE_TO_UNICODE)}


def bytes_to_byte_level(data: bytes) -> str:
    """Token bytes -> the byte-level string HF uses as its vocab key (b" the" -> "Ġthe")."""
    return data.decode("latin-1").translate(_TO_STAND_IN)


def byte_level_to_bytes(text: str) -> bytes:
    """A byte-level vocab string back to the token's bytes; any other character is an error."""
    foreign = set(text) - UNICODE_TO_BYTE.keys()
    if foreign:
        raise TinyLMError(
            f"vocab entry {text!r} has character(s) {sorted(foreign)} that are not GPT-2 byte-level "
            "characters; this tokenizer.json is not byte-level BPE"
        )
    return text.translate(_FROM_STAND_IN).encode("latin-1")


# ----- tiktoken ranks (.tiktoken) ---------------------------------------------------------


def save_tiktoken(tok: BPETokenizer, path: str | os.PathLike) -> Path:
    """Write ``tok``'s base vocabulary as a tiktoken ranks file (``base64 rank`` per line).

    Only the bytes and ids are written: the format has no place for the split pattern or the
    special tokens, so pass them to `load_tiktoken` (or to ``tiktoken.Encoding``) yourself.
    """
    _require_bpe(tok, "tiktoken")
    lines = [f"{base64.b64encode(tok.vocab[i]).decode('ascii')} {i}\n" for i in range(tok.base_vocab_size)]
    return atomic_write_text(Path(path), "".join(lines))


def read_tiktoken_ranks(path: str | os.PathLike) -> dict[bytes, int]:
    """Parse a tiktoken ranks file into token bytes -> rank, with errors that name the line."""
    path = Path(path)
    ranks: dict[bytes, int] = {}
    for lineno, line in enumerate(_read_text(path, "tiktoken file").splitlines(), 1):
        if not line.strip():
            continue
        fields = line.split()
        try:
            if len(fields) != 2:
                raise ValueError("expected two fields")
            token, rank = base64.b64decode(fields[0], validate=True), int(fields[1])
        except (ValueError, binascii.Error):
            raise TinyLMError(
                f"{path} line {lineno} is not 'base64-bytes rank' ({line[:60]!r}); is it a tiktoken file?"
            ) from None
        if token in ranks:
            raise TinyLMError(f"{path} line {lineno}: token {token!r} already has rank {ranks[token]}")
        ranks[token] = rank
    return ranks


def merges_from_ranks(ranks: dict[bytes, int], source: str = "<ranks>") -> list[tuple[int, int]]:
    """Recover the merge list from tiktoken ranks laid out as tinylm's ids.

    The ranks must be 0..N-1 with the single bytes at 0..255 in byte order. For each token of
    rank r >= 256 we run BPE on its bytes with only the ranks below r, exactly as tiktoken
    would have when r was learned: it must stop at two tokens, and those two are the merge.
    (With fewer merges the result is longer; any more and the token itself would appear.)
    """
    by_rank = sorted(ranks.items(), key=lambda item: item[1])
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise TinyLMError(f"{source}: the ranks are not 0..{len(ranks) - 1} without gaps or repeats")
    if len(ranks) < 256:
        raise TinyLMError(f"{source} has {len(ranks)} tokens; byte-level BPE needs at least the 256 bytes")
    for rank, (token, _) in enumerate(by_rank[:256]):
        if token != bytes([rank]):
            raise TinyLMError(
                f"{source}: rank {rank} is {token!r}, but tinylm's id layout needs the single byte "
                f"{bytes([rank])!r} there (bytes 0..255 at ranks 0..255 in byte order). This file orders "
                "the bytes differently (as OpenAI's r50k/cl100k/o200k files do), so importing it would "
                "renumber tokens; tinylm cannot load it"
            )
    merges: list[tuple[int, int]] = []
    for token, rank in by_rank[256:]:
        parts = _bpe_below(token, ranks, rank)
        if len(parts) != 2:
            raise TinyLMError(
                f"{source}: token {token!r} (rank {rank}) is not the merge of two earlier tokens "
                f"(BPE with the lower ranks gives {len(parts)} pieces); it is not a BPE merge list "
                "tinylm can represent"
            )
        merges.append((ranks[parts[0]], ranks[parts[1]]))
    return merges


def _bpe_below(token: bytes, ranks: dict[bytes, int], max_rank: int) -> list[bytes]:
    """tiktoken's rule on ``token``'s bytes: merge the lowest-rank joined pair, ranks < max_rank only."""
    parts = [bytes([b]) for b in token]
    while len(parts) > 1:
        best, best_rank = -1, max_rank
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < best_rank:  # strict: the leftmost of equal ranks wins
                best, best_rank = i, r
        if best < 0:
            break
        parts[best : best + 2] = [parts[best] + parts[best + 1]]
    return parts


def load_tiktoken(path: str | os.PathLike, pattern: str = "gpt4", n_reserved: int = 0) -> Tokenizer:
    """Load a tiktoken ranks file; every rank stays the token's id.

    ``pattern`` (a name in `PATTERNS` or a regex) and ``n_reserved`` are not in the file and
    must be given; the special tokens bos, eos, pad and the reserved range follow the highest rank.
    A file in tinylm's own layout (as `save_tiktoken` writes) gives back a `BPETokenizer`; any other
    (OpenAI's cl100k/o200k, whose bytes are in another order) a `ByteLevelBPETokenizer` that
    encodes exactly as ``tiktoken.Encoding`` does with the same ranks.
    """
    ranks = read_tiktoken_ranks(path)
    try:
        return BPETokenizer(merges_from_ranks(ranks, str(path)), pattern=pattern, n_reserved=n_reserved)
    except TinyLMError:
        pass
    if len(set(ranks.values())) != len(ranks):
        raise TinyLMError(f"{path}: two tokens share a rank; a tiktoken file gives every token its own")
    size = checked_vocab_size(ranks.items(), source=str(path), what="rank")
    tokens: list[bytes | None] = [None] * size
    for token, rank in ranks.items():
        tokens[rank] = token
    specials = {name: size + i for i, name in enumerate(special_token_names(n_reserved))}
    return ByteLevelBPETokenizer(tokens, [], pattern, specials=specials, roles={"bos": BOS, "eos": EOS, "pad": PAD},
                                 ignore_merges=True)


# ----- Oniguruma <-> tiktoken regex dialects ------------------------------------------------

# A counted repeat {m}, {m,}, {m,n} (a bare "{" is a literal in every engine involved).
_INTERVAL = regex.compile(r"\{\d+(?:,\d*)?\}")


def oniguruma_pattern(pattern: str) -> str:
    """Our split pattern (a name or a regex) as a regex Oniguruma runs the same way.

    ``X{m,n}+`` (possessive, for tiktoken) becomes the atomic group ``(?>X{m,n})``, its
    definition; ``$`` (end of text, for tiktoken) becomes ``\\z``. Everything else is kept.
    The pattern must match every character, as ours do: tiktoken drops text that no match
    covers, while HF's Split keeps it as a piece of its own.
    """
    return _rewrite_regex(PATTERNS.get(pattern, pattern), lambda atom, rep: f"(?>{atom}{rep})", r"\z")


def pattern_from_oniguruma(pattern: str) -> str:
    """The inverse direction: an Oniguruma split regex as a pattern for tinylm (and tiktoken).

    Our own exported patterns come back as their names; in any other regex Oniguruma's
    ``X{m,n}+`` (a repeat of the interval) becomes ``(?:X{m,n})+`` and its ``$`` (end of
    any line) becomes ``(?=\\n|\\z)``. Other Oniguruma-only syntax is passed through as is.
    """
    for name in PATTERNS:
        if pattern == oniguruma_pattern(name):
            return name
    return _rewrite_regex(pattern, lambda atom, rep: f"(?:{atom}{rep})+", r"(?=\n|\z)")


def _rewrite_regex(pattern: str, interval_plus: Callable[[str], str], dollar: str) -> str:
    """Walk a regex atom by atom; rewrite ``ATOM{m,n}+`` with ``interval_plus`` and ``$`` as ``dollar``.

    Each atom (a character, an escape, a class, a whole group) is kept as one string with its
    quantifiers attached, so an interval always knows which atom it repeats.
    """
    atoms: list[str] = []  # the atoms of the group being read
    outer: list[list[str]] = []  # the atoms of the groups around it
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\":
            j = _escape_end(pattern, i)
            atoms.append(pattern[i:j])
        elif c == "[":
            j = _class_end(pattern, i)
            atoms.append(pattern[i:j])
        elif c == "(":
            outer.append(atoms)
            atoms, j = ["("], i + 1  # "(?:", "(?>", "(?i:" ... are read as atoms of the group
        elif c == ")" and outer:
            group = "".join(atoms) + ")"
            atoms, j = outer.pop(), i + 1
            atoms.append(group)
        elif c == "{" and atoms and (m := _INTERVAL.match(pattern, i)):
            j = m.end()
            if j < n and pattern[j] == "+":
                atoms[-1] = interval_plus(atoms[-1], m.group())
                j += 1
            else:
                atoms[-1] += m.group()
        elif c in "*+?" and atoms:
            atoms[-1] += c
            j = i + 1
        elif c == "$":
            atoms.append(dollar)
            j = i + 1
        else:
            atoms.append(c)
            j = i + 1
        i = j
    while outer:  # an unbalanced "(": leave the text as it was; the regex engine will complain
        atoms = outer.pop() + atoms
    return "".join(atoms)


def _escape_end(p: str, i: int) -> int:
    """End of the escape starting at p[i] == "\\" (\\p{L}, \\pL, \\x41, \\x{263A}, \\u00e9, \\n ...)."""
    kind = p[i + 1 : i + 2]
    if kind in ("p", "P", "x", "N") and p[i + 2 : i + 3] == "{":
        close = p.find("}", i + 3)
        return close + 1 if close >= 0 else len(p)
    widths = {"p": 3, "P": 3, "x": 4, "u": 6, "U": 10}
    return min(i + widths.get(kind, 2), len(p))


def _class_end(p: str, i: int) -> int:
    """End of the character class starting at p[i] == "[" (a "]" first in the class is literal)."""
    j = i + 1
    if p[j : j + 1] == "^":
        j += 1
    if p[j : j + 1] == "]":
        j += 1
    while j < len(p):
        if p[j] == "\\":
            j = _escape_end(p, j)
        elif p.startswith("[:", j):  # POSIX class [:alpha:]
            close = p.find(":]", j + 2)
            j = close + 2 if close >= 0 else len(p)
        elif p[j] == "]":
            return j + 1
        else:
            j += 1
    return len(p)


# ----- Hugging Face tokenizer.json ----------------------------------------------------------


def to_hf_tokenizer_json(tok: Tokenizer) -> dict[str, Any]:
    """``tok`` as a Hugging Face tokenizer.json (a dict; `save_hf_tokenizer_json` writes it): tinylm's byte-level
    BPE in tinylm's id layout, or an imported tokenizer with its author's ids (`imported_to_hf_json`).

    Loaded with ``tokenizers.Tokenizer.from_file`` it gives the same ids as ``tok.encode`` on
    text without special-token names (and the same as ``allowed_special="all"`` on text with
    them: HF always treats them as special), and the same decoding.
    """
    if isinstance(tok, ImportedTokenizer):
        return imported_to_hf_json(tok)
    _require_bpe(tok, "hf")
    assert isinstance(tok, BPETokenizer)
    spell = [bytes_to_byte_level(b) for b in tok.vocab]
    byte_level = _byte_level_step(add_prefix_space=False)
    return _tokenizer_json(
        added_tokens=_added_tokens((i, name, True) for name, i in tok.special_tokens.items()),
        normalizer=None,
        pre_tokenizer=_split_then(tok.pattern, byte_level),
        post_processor=None,  # tinylm adds bos itself where a model needs x_0
        decoder=dict(byte_level),  # decoding only maps the characters back to bytes
        # ignore_merges false: run BPE on every chunk, even one that is a vocab entry. The merges as "left right"
        # strings: every tokenizers version reads them (0.20+ writes pairs, and reads both), and byte-level
        # strings never contain a space, so the split is exact
        model=_bpe_model({s: i for i, s in enumerate(spell)}, [f"{spell[a]} {spell[b]}" for a, b in tok.merges]),
    )


def imported_to_hf_json(tok: ImportedTokenizer) -> dict[str, Any]:
    """An imported tokenizer as a tokenizer.json that gives the same ids (its author's ids)."""
    added = _added_tokens(sorted([(i, name, True) for name, i in tok.special_tokens.items()] +
                                 [(i, name, False) for name, i in tok.added_words.items()]))
    if isinstance(tok, ByteLevelBPETokenizer):
        spell = {i: bytes_to_byte_level(b) for i, b in enumerate(tok.tokens)
                 if b is not None and i not in tok.added_words.values()}
        byte_level = _byte_level_step(tok.add_prefix_space)
        if tok.add_prefix_space:  # only ByteLevel alone puts the space before a whole text (not every chunk)
            name = pattern_name(tok.pattern)
            if name not in ("gpt2", "none"):
                raise TinyLMError("a byte-level tokenizer that adds a prefix space splits with GPT-2's pattern (or "
                                  f"none) in tokenizer.json, not {name or tok.pattern!r}")
            pre = {**byte_level, "use_regex": name == "gpt2"}
        else:
            pre = _split_then(tok.pattern, byte_level)
        return _tokenizer_json(
            added_tokens=added, normalizer={"type": tok.normalizer} if tok.normalizer else None, pre_tokenizer=pre,
            post_processor=_post_processor(tok), decoder={**byte_level, "use_regex": True},
            # the added tokens are in the model's vocab too, as the `tokenizers` trainer writes them
            # (without them its id -> token table misses their ids, and decodes ids past them wrongly)
            model=_bpe_model({**{s: i for i, s in spell.items()}, **tok.special_tokens, **tok.added_words},
                             [[spell[a], spell[b]] for a, b in tok.merges], ignore_merges=tok.ignore_merges))
    assert isinstance(tok, SentencePieceBPETokenizer)
    vocab = {p: i for i, p in enumerate(tok.pieces) if p is not None}
    vocab.update(tok.special_tokens)
    pre = None
    normalizer: dict[str, Any] | None = {"type": "Sequence", "normalizers": [
        {"type": "Prepend", "prepend": SPACE_MARK}, {"type": "Replace", "pattern": {"String": " "},
                                                     "content": SPACE_MARK}]}
    if tok.prefix != "prepend":
        normalizer = None
        pre = {"type": "Metaspace", "replacement": SPACE_MARK, "prepend_scheme": tok.prefix, "split": tok.split_on_mark}
    decoders: list[dict[str, Any]] = [{"type": "Replace", "pattern": {"String": SPACE_MARK}, "content": " "},
                                      {"type": "ByteFallback"}, {"type": "Fuse"}]
    if tok.strip_leading_space:
        decoders.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
    return _tokenizer_json(
        added_tokens=added, normalizer=normalizer, pre_tokenizer=pre, post_processor=_post_processor(tok),
        decoder={"type": "Sequence", "decoders": decoders},
        model=_bpe_model(vocab, [[tok.pieces[a], tok.pieces[b]] for a, b in tok.merges], unk_token=tok.unk,
                         fuse_unk=tok.fuse_unk, byte_fallback=tok.byte_fallback))


def _tokenizer_json(*, added_tokens: list[dict[str, Any]], normalizer: dict[str, Any] | None,
                    pre_tokenizer: dict[str, Any] | None, post_processor: dict[str, Any] | None,
                    decoder: dict[str, Any], model: dict[str, Any]) -> dict[str, Any]:
    """A whole tokenizer.json, its parts in the order `tokenizers` writes them."""
    return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added_tokens,
            "normalizer": normalizer, "pre_tokenizer": pre_tokenizer, "post_processor": post_processor,
            "decoder": decoder, "model": model}


def _added_tokens(rows: Iterable[tuple[int, str, bool]]) -> list[dict[str, Any]]:
    """The added_tokens entries of (id, name, special) rows: each matched exactly as it is written."""
    return [{"id": i, "content": name, "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": special} for i, name, special in rows]


def _bpe_model(vocab: dict[str, int], merges: list[Any], *, unk_token: str | None = None, fuse_unk: bool = False,
               byte_fallback: bool = False, ignore_merges: bool = False) -> dict[str, Any]:
    return {"type": "BPE", "dropout": None, "unk_token": unk_token, "continuing_subword_prefix": None,
            "end_of_word_suffix": None, "fuse_unk": fuse_unk, "byte_fallback": byte_fallback,
            "ignore_merges": ignore_merges, "vocab": vocab, "merges": merges}


def _byte_level_step(add_prefix_space: bool) -> dict[str, Any]:
    """ByteLevel that only maps bytes to their stand-ins (use_regex false: the step before it cut the chunks)."""
    return {"type": "ByteLevel", "add_prefix_space": add_prefix_space, "trim_offsets": False, "use_regex": False}


def _split_then(pattern: str, byte_level: dict[str, Any]) -> dict[str, Any]:
    """The pre_tokenizer that cuts a text with ``pattern`` (a name or a regex) and then maps its bytes."""
    return {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": oniguruma_pattern(pattern)}, "behavior": "Isolated", "invert": False},
        byte_level]}


def _post_processor(tok: ImportedTokenizer) -> dict[str, Any] | None:
    if not tok.add_bos:
        return None
    bos = tok.roles["bos"]
    return {"type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": bos, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {bos: {"id": bos, "ids": [tok.bos_id], "tokens": [bos]}}}


def save_hf_tokenizer_json(tok: Tokenizer, path: str | os.PathLike) -> Path:
    """Write `to_hf_tokenizer_json` to ``path`` (a tokenizer.json file)."""
    return atomic_write_text(Path(path), json.dumps(to_hf_tokenizer_json(tok), ensure_ascii=False, indent=2) + "\n")


def load_hf_tokenizer_json(path: str | os.PathLike) -> BPETokenizer:
    """Read a tokenizer.json with tinylm's layout (as `save_hf_tokenizer_json` writes a `BPETokenizer`) back."""
    return tokenizer_from_hf_json(read_hf_tokenizer_json(path), str(path))


def read_hf_tokenizer_json(path: str | os.PathLike) -> dict[str, Any]:
    """The object in a tokenizer.json file, or one line saying why there is none; what is in it is for the
    reader of its layout to check (`tokenizer_from_hf_json`, `tinylm.tokenizers.hf_files`)."""
    return read_json_object(path, not_object="{path} is {kind}, not a Hugging Face tokenizer.json")


# ----- the entries of a tokenizer.json (or vocab.json + merges.txt), checked as `tokenizers` checks them -----


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def hf_vocab(vocab: Any, source: str, where: str = "the vocab") -> dict[str, int]:
    """``vocab`` if it is an object of token -> id, each id a whole number from 0, else one line naming the entry."""
    if not isinstance(vocab, dict):
        raise TinyLMError(f"{source}: {where} is {json_kind(vocab)}, not an object of token -> id")
    for text, i in vocab.items():
        if not _is_id(i):
            raise TinyLMError(f"{source}: {where} gives {text!r} the id {i!r}; an id is a whole number from 0")
    return vocab


def hf_merges(merges: Any, vocab: dict[str, int], source: str) -> list[tuple[str, str]]:
    """The merges ("a b" strings, or ["a", "b"] pairs) as pairs; each side and what it makes must be in ``vocab``."""
    if merges is None:
        return []
    if not isinstance(merges, list):
        raise TinyLMError(f"{source}: the merges are {json_kind(merges)}, not a list")
    pairs: list[tuple[str, str]] = []
    for rank, m in enumerate(merges):
        pair = m.split(" ") if isinstance(m, str) else m
        if not isinstance(pair, list) or len(pair) != 2 or not all(isinstance(t, str) for t in pair):
            raise TinyLMError(f"{source}: merge {rank} is {m!r}, not two tokens (\"a b\" or [\"a\", \"b\"])")
        left, right = pair
        for role, token in (("uses", left), ("uses", right), ("makes", left + right)):
            if token not in vocab:
                raise TinyLMError(f"{source}: merge {rank} ({left!r}, {right!r}) {role} {token!r}, which is not in "
                                  "the vocab")
        pairs.append((left, right))
    return pairs


def hf_added_tokens(added: Any, source: str) -> tuple[dict[str, int], dict[str, int]]:
    """The added tokens as (special tokens, other added words), name -> id; one id for one token."""
    if added is None:
        return {}, {}
    if not isinstance(added, list):
        raise TinyLMError(f"{source}: added_tokens is {json_kind(added)}, not a list")
    specials: dict[str, int] = {}
    words: dict[str, int] = {}
    owner: dict[int, str] = {}
    for n, token in enumerate(added):
        name = token.get("content") if isinstance(token, dict) else None
        if not isinstance(name, str) or not name:
            raise TinyLMError(f"{source}: added token {n} ({str(token)[:60]}) has no \"content\" text")
        i = token.get("id")
        if not _is_id(i):
            raise TinyLMError(f"{source}: added token {name!r} has the id {i!r}; an id is a whole number from 0")
        # one id for one token, and one token for one id: either way round, text or ids would be ambiguous
        if owner.setdefault(i, name) != name:
            raise TinyLMError(f"{source}: added tokens {owner[i]!r} and {name!r} share the id {i}; each needs its own")
        earlier = specials.get(name, words.get(name, i))
        if earlier != i:
            raise TinyLMError(f"{source}: the added token {name!r} is listed with the ids {earlier} and {i}; "
                              "keep one")
        (specials if token.get("special") else words)[name] = i
    return specials, words


# each part of the pipeline, and the key of a Sequence's steps in it
PIPELINE_PARTS = {"normalizer": "normalizers", "pre_tokenizer": "pretokenizers", "post_processor": "processors",
                  "decoder": "decoders"}


def hf_pipeline(data: dict[str, Any], source: str) -> None:
    """Check that each part of a tokenizer.json's pipeline is null or an object, and the steps of a Sequence (of
    Sequences ...) a list of objects, as `tokenizers` requires: the readers then look into them without tracebacks."""
    for part, steps_key in PIPELINE_PARTS.items():
        todo = [] if data.get(part) is None else [data[part]]
        while todo:
            node = todo.pop()
            if not isinstance(node, dict):
                raise TinyLMError(f"{source}: the {part} (or a step in it) is {json_kind(node)}, not an object")
            if node.get("type") == "Sequence":
                steps = node.get(steps_key)
                if not isinstance(steps, list):
                    raise TinyLMError(f"{source}: the {part} is a Sequence whose {steps_key!r} is "
                                      f"{json_kind(steps)}, not a list")
                todo.extend(steps)


def hf_bpe_model(data: dict[str, Any], fail: Callable[[str], TinyLMError]) -> dict[str, Any]:
    """The "model" of a parsed tokenizer.json if it is a BPE without the options no tinylm tokenizer has (a word
    prefix or suffix, dropout); anything else is ``fail``."""
    model = data["model"]
    # type is optional in the file: tokenizers infers BPE from the fields
    if model.get("type", "BPE") != "BPE":
        raise fail(f"the model is {model.get('type')}, not BPE")
    for key in ("continuing_subword_prefix", "end_of_word_suffix", "dropout"):
        if model.get(key):
            raise fail(f"the BPE model sets {key}={model[key]!r}")
    return model


def hf_entries(data: dict[str, Any], source: str) -> tuple[dict[str, int], list[tuple[str, str]], dict[str, int],
                                                            dict[str, int]]:
    """The vocab, merges, special tokens and other added words of a parsed tokenizer.json, each checked
    (`hf_vocab`, `hf_merges`, `hf_added_tokens`)."""
    model = data["model"]
    vocab = hf_vocab(model.get("vocab", {}), source)
    return vocab, hf_merges(model.get("merges"), vocab, source), *hf_added_tokens(data.get("added_tokens"), source)


def tokenizer_from_hf_json(data: dict[str, Any], source: str = "<tokenizer.json>", *,
                           chat_template: str | None = None) -> BPETokenizer:
    """Rebuild a BPETokenizer from a parsed tokenizer.json, or say what does not map.

    ``chat_template``: the template the folder's tokenizer_config.json gives, for a fine-tuned model's tokenizer
    (one with ChatML's two markers after its other special tokens: `_own_special_tokens`).
    """

    def fail(what: str) -> TinyLMError:
        return TinyLMError(f"{source}: {what}; tinylm reads byte-level BPE tokenizer.json files in its own id layout")

    model = data.get("model") if isinstance(data, dict) else None
    if not isinstance(model, dict) or "vocab" not in model:
        raise fail("no model with a vocab (not a Hugging Face tokenizer.json)")
    hf_bpe_model(data, fail)
    if model.get("byte_fallback"):
        raise fail("the BPE model uses byte_fallback (<0xNN> tokens), which tinylm's byte-level BPE does not have")
    if model.get("ignore_merges"):
        raise fail("ignore_merges is true (whole-chunk vocab hits skip the merges), which tinylm cannot reproduce")
    hf_pipeline(data, source)
    if data.get("normalizer"):
        raise fail(f"it has a {data['normalizer'].get('type')} normalizer, which tinylm does not apply")
    post = data.get("post_processor")
    if post and post.get("type") != "ByteLevel" and not _start_template(post):
        raise fail(f"it has a {post.get('type')} post-processor (it adds tokens), which tinylm does not apply")
    decoder = data.get("decoder")
    if decoder and decoder.get("type") != "ByteLevel":
        raise fail(f"its decoder is {decoder.get('type')}, not ByteLevel")
    pattern = _pattern_from_pre_tokenizer(data.get("pre_tokenizer"), fail)

    # vocab and merges -> tinylm's merge list, checking the id layout as we go
    vocab, pairs, specials, words = hf_entries(data, source)
    base = 256 + len(pairs)
    by_id: dict[int, bytes] = {}
    for text, i in vocab.items():
        if i in by_id:
            raise fail(f"id {i} appears twice in the vocab")
        by_id[i] = byte_level_to_bytes(text) if i < base else b""
    for b in range(256):
        if by_id.get(b) != bytes([b]):
            raise fail(
                f"id {b} is {by_id.get(b)!r}, not the byte {bytes([b])!r}: the 256 bytes are not at ids "
                "0..255 in byte order (GPT-2 and Llama 3 files order them differently)"
            )
    merges: list[tuple[int, int]] = []
    for rank, (left, right) in enumerate(pairs):
        made = vocab[left + right]
        if made != 256 + rank:
            raise fail(f"merge {rank} makes id {made}, but tinylm's layout puts merge r at id 256 + r = {256 + rank}")
        merges.append((vocab[left], vocab[right]))

    # the added tokens must be exactly tinylm's specials, right after the merges
    added = {**specials, **words}
    extra = set(vocab.values()) - set(range(base)) - set(added.values())
    if extra:
        raise fail(f"vocab ids {sorted(extra)[:5]} are neither bytes, merges nor added tokens")
    return _own_special_tokens(merges, pattern, added, chat_template, fail)


def _own_special_tokens(merges: list[tuple[int, int]], pattern: str, added: dict[str, int], chat_template: str | None,
                       fail: Callable[[str], TinyLMError]) -> BPETokenizer:
    """The BPETokenizer of ``merges`` and ``pattern`` with the special tokens ``added`` (name -> id) if they are
    tinylm's, in tinylm's order right after the merges: bos, eos, pad, the reserved range and, in a fine-tuned model's
    tokenizer, ChatML's two markers; anything else is ``fail``.

    The markers get ``chat_template``, or ChatML's own where none is given (a tokenizer.json alone): tinylm adds
    them with that template only (`tinylm.tokenizers.chat_template.with_chat_tokens`), so the file reads back as
    the tokenizer it was written from, which ends a reply at ``<|im_end|>``.
    """
    for name in (BOS, EOS, PAD):
        if name not in added:
            raise fail(
                f"the special token {name} is missing (it has {sorted(added)[:6]}); tinylm tokenizers "
                f"have {BOS}, {EOS}, {PAD} and <|reserved_i|> right after the merges"
            )
    chat = [CHAT_START, CHAT_END] if CHAT_START in added and CHAT_END in added else []
    n_reserved = len(added) - 3 - len(chat)
    tok = BPETokenizer(merges, pattern=pattern, n_reserved=max(n_reserved, 0))
    if chat:
        tok._add_chat_tokens(chat, chat_template or CHATML_TEMPLATE)
    if added != tok.special_tokens:
        base = tok.base_vocab_size
        raise fail(
            f"the added tokens {added} are not tinylm's {BOS}, {EOS}, {PAD}, <|reserved_0|>... "
            f"(then {CHAT_START}, {CHAT_END} after chat fine-tuning) at ids {base}, {base + 1}, ..."
        )
    return tok


def _start_template(post: dict[str, Any]) -> bool:
    """Whether a post-processor only puts one special token before a text, as tinylm's exports declare the
    token their model's texts start with (the run puts it there itself: `tinylm.run.start_ids`)."""
    single = post.get("single")
    return (post.get("type") == "TemplateProcessing" and isinstance(single, list) and len(single) == 2
            and isinstance(single[0], dict) and "SpecialToken" in single[0]
            and single[1] == {"Sequence": {"id": "A", "type_id": 0}})


def _pattern_from_pre_tokenizer(pre: dict[str, Any] | None, fail: Callable[[str], TinyLMError]) -> str:
    """The split pattern a pre_tokenizer stands for: Split(Regex) + ByteLevel, or GPT-2's ByteLevel."""
    pattern, prefix_space = byte_level_pre_tokenizer(pre, fail)
    if prefix_space:
        raise fail("ByteLevel adds a prefix space, which tinylm's own BPE does not do")
    return pattern


# `Digits` then ByteLevel's GPT-2 regex, as one pattern: a digit (or a run of them) is a chunk of its own, and
# since the regex then runs on the text between digits, a digit ends a whitespace run as the end of the text
# does (``\s+(?![^\s\p{N}])`` where GPT-2 has ``\s+(?!\S)``) and no chunk starts with a space before one.
_GPT2_WITHOUT_DIGITS = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?[^\s\p{L}\p{N}]+|\s+(?![^\s\p{N}])|\s+"""
DIGITS_THEN_GPT2 = {True: _GPT2_WITHOUT_DIGITS + r"|\p{N}", False: _GPT2_WITHOUT_DIGITS + r"|\p{N}+"}


def byte_level_pre_tokenizer(pre: dict[str, Any] | None, fail: Callable[[str], TinyLMError]) -> tuple[str, bool]:
    """The split pattern of a ByteLevel pre_tokenizer (alone, or after one Split) and its add_prefix_space."""
    steps = pre.get("pretokenizers", []) if pre and pre.get("type") == "Sequence" else [pre] if pre else []
    if not steps or steps[-1].get("type") != "ByteLevel":
        raise fail("the pre_tokenizer does not end in ByteLevel, so the model does not see bytes")
    byte_level = steps[-1]
    prefix_space = bool(byte_level.get("add_prefix_space"))
    if len(steps) == 1:
        # ByteLevel's own regex is GPT-2's original pattern; our "gpt2" gives the same chunks
        return ("gpt2" if byte_level.get("use_regex", True) else "none"), prefix_space
    if len(steps) == 2 and prefix_space:
        raise fail("ByteLevel adds a prefix space to every chunk the step before it cut, which tinylm does not do")
    if len(steps) == 2 and steps[0].get("type") == "Digits" and byte_level.get("use_regex", True):
        # SmolLM's: digits cut out first (one by one, or in runs), then GPT-2's regex within the rest
        return DIGITS_THEN_GPT2[bool(steps[0].get("individual_digits"))], prefix_space
    if len(steps) != 2 or byte_level.get("use_regex", True):
        kinds = " + ".join(str(step.get("type")) for step in steps)
        raise fail(f"the pre_tokenizer is {kinds}, not Split(regex) followed by ByteLevel(use_regex=false)")
    split = steps[0]
    pattern = split.get("pattern")
    regex_text = pattern.get("Regex") if isinstance(pattern, dict) else None
    if split.get("type") != "Split" or regex_text is None:
        raise fail(f"the pre_tokenizer step {split.get('type')} is not a Split on a regex")
    if split.get("behavior") != "Isolated" or split.get("invert"):
        raise fail(f"the Split behaviour is {split.get('behavior')} (invert={split.get('invert')}), not Isolated")
    return pattern_from_oniguruma(regex_text), prefix_space


# ----- shared checks ------------------------------------------------------------------------


def _require_bpe(tok: Tokenizer, fmt: str) -> None:
    if not isinstance(tok, BPETokenizer):
        raise TinyLMError(
            f"a {tok.kind} tokenizer cannot be exported as {fmt}: that format holds byte-level BPE "
            "only; save it in the tinylm format instead"
        )
