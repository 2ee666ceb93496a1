"""One entry point for every tokenizer file: `import_tokenizer` reads any of them, `export_tokenizer` writes them.

Formats (`FORMATS`): tinylm's own JSON file ("tinylm"), a tiktoken ranks file ("tiktoken"), and Hugging
Face's tokenizer.json ("hf"; also GPT-2's vocab.json + merges.txt on the way in). `detect_format` tells
them apart by content. The formats themselves are `tinylm.tokenizers.formats` (tinylm's layout, .tiktoken
ranks, regex dialects) and `tinylm.tokenizers.hf_files` (any Hugging Face layout).

Usage::

    tok = import_tokenizer("~/models/SmolLM2/")         # a folder, a tokenizer.json, a .tiktoken file...
    export_tokenizer(tok, "out/", "hf")                 # out/tokenizer.json
"""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path

import regex

from tinylm.atomic import atomic_write_text
from tinylm.errors import TinyLMError
from tinylm.jsonfile import parse_json
from tinylm.tokenizers.base import FORMAT_NAME, Tokenizer, load_tokenizer
from tinylm.tokenizers.bpe import BPETokenizer
from tinylm.tokenizers.formats import (
    DEFAULT_FILENAMES,
    FORMATS,
    _read_text,
    _require_bpe,
    load_tiktoken,
    save_tiktoken,
    to_hf_tokenizer_json,
)
from tinylm.tokenizers.hf_files import read_hf_tokenizer
from tinylm.tokenizers.imported import ByteLevelBPETokenizer


def export_tokenizer(tok: Tokenizer, path: str | os.PathLike, format: str, *, overwrite: bool = False) -> Path:
    """Write ``tok`` as ``format`` ("tinylm", "tiktoken" or "hf"); returns the file written.

    ``path`` is a file, or a folder (an existing one, or a path without a suffix), in which
    case the format's usual name is used (`DEFAULT_FILENAMES`: tokenizer.json for hf).
    """
    if format not in FORMATS:
        raise TinyLMError(f"unknown tokenizer format {format!r}; expected one of {', '.join(FORMATS)}")
    path = Path(path)
    if path.is_dir() or not path.suffix:
        path = path / DEFAULT_FILENAMES[format]
    if path.exists() and not overwrite:
        raise TinyLMError(f"{path} already exists; choose another output or overwrite it explicitly (--force)")
    if format == "tinylm":
        return tok.save(path)
    if format == "hf":
        return atomic_write_text(path, json.dumps(to_hf_tokenizer_json(tok), ensure_ascii=False, indent=2) + "\n")
    if format == "tiktoken" and isinstance(tok, ByteLevelBPETokenizer):
        # the ranks tiktoken merges with are the ids; the specials and the split pattern have no place in the file
        lines = [f"{base64.b64encode(b).decode('ascii')} {i}\n" for b, i in sorted(tok._token_ids.items(),
                                                                                   key=lambda kv: kv[1])]
        return atomic_write_text(path, "".join(lines))
    _require_bpe(tok, format)
    assert isinstance(tok, BPETokenizer)
    return save_tiktoken(tok, path)


_TIKTOKEN_LINE = regex.compile(r"[A-Za-z0-9+/]+=*\s+\d+")


def detect_format(path: str | os.PathLike) -> str:
    """Which of `FORMATS` a file is in, from its content (the name is only a hint)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except FileNotFoundError:
        raise TinyLMError(f"tokenizer file {path} does not exist") from None
    except OSError as e:
        raise TinyLMError(f"cannot read tokenizer file {path}: {e}") from None
    text = head.decode("utf-8", errors="replace").lstrip()
    if text.startswith("{"):
        try:
            data = parse_json(_read_text(path, "tokenizer file"), path)
        except json.JSONDecodeError as e:
            raise TinyLMError(f"{path} is not valid JSON (line {e.lineno}, column {e.colno})") from None
        if isinstance(data, dict) and data.get("format") == FORMAT_NAME:
            return "tinylm"
        if isinstance(data, dict) and "model" in data:
            return "hf"
        if isinstance(data, dict) and data and (path.parent / "merges.txt").is_file():
            return "hf"  # GPT-2's own vocab.json, with merges.txt beside it (its reader checks each id)
        raise TinyLMError(f"{path} is JSON but neither a tinylm tokenizer nor a Hugging Face tokenizer.json")
    first_line = text.split("\n", 1)[0].strip()
    if path.suffix == ".tiktoken" or _TIKTOKEN_LINE.fullmatch(first_line):
        return "tiktoken"
    raise TinyLMError(
        f"{path} is neither a tinylm tokenizer, a Hugging Face tokenizer.json nor a tiktoken ranks file"
    )


def import_tokenizer(
    path: str | os.PathLike, *, pattern: str | None = None, n_reserved: int | None = None,
    roles: dict[str, str] | None = None,
) -> Tokenizer:
    """Load a tokenizer from a tinylm file, a tokenizer.json, GPT-2's vocab.json + merges.txt or a .tiktoken
    file (or a folder with one), keeping every id the file gives.

    ``pattern`` and ``n_reserved`` are for .tiktoken files only, which do not record them
    (defaults "gpt4" and 0); the other formats carry their own. ``roles`` names the bos, eos or pad
    token of a Hugging Face tokenizer whose files do not (see `tinylm.tokenizers.hf_files`).
    """
    path = Path(path)
    if path.is_dir():
        found = [path / name for name in ("tokenizer.json", "vocab.json", "tinylm_tokenizer.json", "tokenizer.tiktoken")]
        found = [p for p in found if p.is_file()] or sorted(path.glob("*.tiktoken"))
        if not found:
            raise TinyLMError(f"{path} has no tokenizer.json, vocab.json + merges.txt, tinylm_tokenizer.json or "
                              "*.tiktoken file")
        path = found[0]
    fmt = detect_format(path)
    if fmt == "tiktoken":
        if roles:
            raise TinyLMError(f"{path} is a .tiktoken file, which has no special tokens to name as bos, eos or pad; "
                              "tinylm adds its own after the ranks")
        return load_tiktoken(path, pattern=pattern or "gpt4", n_reserved=n_reserved or 0)
    if pattern is not None or n_reserved is not None:
        raise TinyLMError(
            f"{path} is a {fmt} file, which records its own split pattern and special tokens; "
            "pattern and n_reserved are only for .tiktoken files"
        )
    if fmt == "tinylm":
        if roles:
            raise TinyLMError(f"{path} is a tinylm tokenizer, whose bos, eos and pad are fixed; --bos/--eos/--pad "
                              "are for Hugging Face files")
        return load_tokenizer(path)
    return read_hf_tokenizer(path, roles=roles)


__all__ = ["FORMATS", "export_tokenizer", "detect_format", "import_tokenizer"]
