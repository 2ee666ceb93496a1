"""`tinylm tokenizer train|encode|decode|info|export|import`: tokenizers from the command line."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from tinylm.cli.flags import (Parser, add_command, add_corpus_flags, add_role_flags, add_tokenizer_training_flags,
                              load_corpus_from, read_input, roles_from, show_help, train_tokenizer_from)
from tinylm.errors import TinyLMError


def cmd_tokenizer_train(args: argparse.Namespace) -> int:
    """Train a byte-level BPE, character or word tokenizer on a corpus and save it as tinylm JSON."""
    out = Path(args.out)
    if out.exists() and not args.force:
        raise TinyLMError(f"{out} already exists; choose another --out or pass --force to overwrite it")
    corpus = load_corpus_from(args)
    start = time.perf_counter()
    tok = train_tokenizer_from(args, corpus)
    tok.save(out)
    print(f"trained a {tok.kind} tokenizer with |V| = {tok.vocab_size} on {corpus.name} in "
          f"{time.perf_counter() - start:.1f}s; saved to {out}")
    return 0


def cmd_tokenizer_encode(args: argparse.Namespace) -> int:
    """Encode text with a tokenizer. Prints the ids, or with --count the number of tokens, or with --show one line
    per token with its text."""
    from tinylm.tokenizers import load_tokenizer

    tok = load_tokenizer(args.tokenizer)
    text = read_input(args)
    allowed = "all" if args.allow_special else ()
    ids = tok.encode(text, allowed_special=allowed)
    if args.count:
        n_bytes = len(text.encode("utf-8"))
        ratio = n_bytes / len(ids) if ids else 0.0
        print(f"{len(ids)} tokens, {len(text)} characters, {n_bytes} bytes ({ratio:.2f} bytes per token)")
    elif args.show:
        for i, piece in tok.pieces(text, allowed_special=allowed):
            shown = piece.decode("utf-8", errors="backslashreplace")
            print(f"{i:>7}  {shown!r}")
    else:
        print(" ".join(map(str, ids)))
    return 0


def cmd_tokenizer_decode(args: argparse.Namespace) -> int:
    """Decode token ids (arguments or whitespace-separated on stdin) to text."""
    from tinylm.tokenizers import load_tokenizer

    tok = load_tokenizer(args.tokenizer)
    words = args.ids if args.ids else (sys.stdin.read().split() if not sys.stdin.isatty() else [])
    if not words:
        raise TinyLMError("no ids to decode: give them as arguments or on stdin, e.g. `tinylm tokenizer decode --tokenizer tok.json 72 101`")
    try:
        ids = [int(w) for w in words]
    except ValueError:
        bad = next(w for w in words if not w.lstrip("-").isdigit())
        raise TinyLMError(f"token ids must be integers, got {bad!r}") from None
    sys.stdout.write(tok.decode(ids))
    if sys.stdout.isatty():
        sys.stdout.write("\n")
    return 0


def cmd_tokenizer_info(args: argparse.Namespace) -> int:
    """Print a tokenizer's kind, sizes, special tokens, split pattern and fingerprint."""
    from tinylm.tokenizers import load_tokenizer

    tok = load_tokenizer(args.tokenizer)
    info: dict[str, object] = {
        "kind": tok.kind,
        "vocab_size": tok.vocab_size,
        "base_vocab_size": tok.base_vocab_size,
        "special_tokens": tok.special_tokens,
        "fingerprint": tok.fingerprint(),
    }
    if tok.kind == "bpe":
        from tinylm.tokenizers.bpe import pattern_name

        info["pattern"] = pattern_name(tok.pattern) or tok.pattern
        info["merges"] = len(tok.merges)
        longest = sorted(range(256, tok.base_vocab_size), key=lambda i: (-len(tok.token_bytes(i)), i))[:5]
        info["longest_tokens"] = [tok.token_bytes(i).decode("utf-8", "backslashreplace") for i in longest]
    elif tok.kind in ("char", "word"):
        info["unknown"] = tok.unknown
    else:  # imported: the author's ids, roles and pipeline
        info["roles"] = tok.roles
        info["adds_bos"] = tok.add_bos
        info["merges"] = len(tok.merges)
        info["chat_template"] = tok.chat_template is not None
    if args.json:
        print(json.dumps(info, ensure_ascii=False, indent=1))
    else:
        for key, value in info.items():
            print(f"{key:>16}: {value}")
    return 0


def cmd_tokenizer_export(args: argparse.Namespace) -> int:
    """Export a BPE tokenizer for other tools: a Hugging Face tokenizer.json (loads in `tokenizers` and
    `transformers`) or a tiktoken ranks file."""
    from tinylm.tokenizers import load_tokenizer
    from tinylm.tokenizers.files import export_tokenizer

    tok = load_tokenizer(args.tokenizer)
    path = export_tokenizer(tok, args.out, args.format, overwrite=args.force)
    print(f"wrote {args.format} tokenizer to {path}")
    if args.format == "tiktoken":  # the file holds the ranks alone: what else tiktoken.Encoding needs, to copy
        print("the file holds the ranks only; tiktoken.Encoding(name, pat_str=..., mergeable_ranks=..., "
              "special_tokens=...) needs these too:")
        print(f"  pat_str={tok.pattern!r}")
        print(f"  special_tokens={dict(tok.special_tokens)!r}")
    return 0


def cmd_tokenizer_import(args: argparse.Namespace) -> int:
    """Import a Hugging Face tokenizer (tokenizer.json: byte-level BPE such as GPT-2's, Llama 3's or Qwen2's, or
    SentencePiece-style BPE with byte fallback such as Llama 2's and Mistral's; or GPT-2's vocab.json + merges.txt)
    or a tiktoken ranks file as a tinylm tokenizer. Every token keeps its id."""
    from tinylm.tokenizers.files import import_tokenizer

    out = Path(args.out)
    if out.exists() and not args.force:
        raise TinyLMError(f"{out} already exists; choose another --out or pass --force to overwrite it")
    tok = import_tokenizer(args.path, pattern=args.pattern, n_reserved=args.reserved, roles=roles_from(args))
    tok.save(out)
    print(f"imported a {tok.kind} tokenizer with |V| = {tok.vocab_size} from {args.path}; saved to {out}")
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    """tinylm tokenizer and its actions."""
    # tinylm tokenizer ...
    tok = sub.add_parser("tokenizer", help="train, inspect and convert tokenizers",
                         description="Train, use, inspect, export and import tokenizers.")
    tok.set_defaults(func=show_help(tok))
    tsub = tok.add_subparsers(dest="tokenizer_command", metavar="ACTION", parser_class=Parser)

    p = add_command(tsub, "train", cmd_tokenizer_train, "train a tokenizer on a corpus")
    add_corpus_flags(p)
    add_tokenizer_training_flags(p, vocab_default=4096)
    p.add_argument("--out", required=True, help="where to save the tokenizer (JSON)")
    p.add_argument("--force", action="store_true", help="overwrite --out if it exists")

    def add_input(p: argparse.ArgumentParser) -> None:
        p.add_argument("--tokenizer", required=True, help="a tinylm tokenizer JSON file")
        src = p.add_mutually_exclusive_group()
        src.add_argument("--text", help="the text (default: read --file, or stdin)")
        src.add_argument("--file", help="read the text from this UTF-8 file")

    p = add_command(tsub, "encode", cmd_tokenizer_encode, "encode text to ids, count tokens, or show the split")
    add_input(p)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--count", action="store_true", help="print the token, character and byte counts")
    mode.add_argument("--show", action="store_true", help="print each token's id and text, one per line")
    p.add_argument("--allow-special", action="store_true",
                   help="treat special-token text such as <|eos|> in the input as the special token "
                   "(default: it is plain text)")

    p = add_command(tsub, "decode", cmd_tokenizer_decode, "decode ids to text")
    p.add_argument("--tokenizer", required=True, help="a tinylm tokenizer JSON file")
    p.add_argument("ids", nargs="*", help="token ids")

    p = add_command(tsub, "info", cmd_tokenizer_info, "describe a tokenizer")
    p.add_argument("--tokenizer", required=True, help="a tinylm tokenizer JSON file")
    p.add_argument("--json", action="store_true", help="print JSON")

    p = add_command(tsub, "export", cmd_tokenizer_export, "write a BPE tokenizer as tokenizer.json or .tiktoken")
    p.add_argument("--tokenizer", required=True, help="a tinylm tokenizer JSON file")
    p.add_argument("--format", required=True, choices=["hf", "tiktoken"], help="hf or tiktoken")
    p.add_argument("--out", required=True, help="output file (or folder for hf: writes tokenizer.json in it)")
    p.add_argument("--force", action="store_true", help="overwrite --out if it exists")

    p = add_command(tsub, "import", cmd_tokenizer_import,
                    "read a tokenizer.json, vocab.json + merges.txt or .tiktoken file into tinylm")
    p.add_argument("path", help="a tokenizer.json, a vocab.json (merges.txt beside it), a folder holding one, or a "
                   ".tiktoken file; tokenizer_config.json beside it names bos, eos, pad and the chat template")
    p.add_argument("--out", required=True, help="where to save the tinylm tokenizer JSON")
    p.add_argument("--pattern", help="only for .tiktoken files, which carry no split pattern (default: gpt4)")
    p.add_argument("--reserved", type=int, help="only for .tiktoken files, which carry no special tokens: "
                   "how many reserved tokens follow bos, eos, pad (default: 0)")
    add_role_flags(p)
    p.add_argument("--force", action="store_true", help="overwrite --out if it exists")
