"""`tinylm prepare`: a corpus to train/validation token shards."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from tinylm.cli.flags import (add_corpus_flags, add_tokenizer_training_flags, fraction, load_corpus_from, seed_int,
                              train_tokenizer_from)
from tinylm.config import corpus_stem


def cmd_prepare(args: argparse.Namespace) -> int:
    from tinylm.data.shards import check_output_folder
    from tinylm.lock import folder_lock

    corpus = load_corpus_from(args)
    out = Path(args.out) if args.out else Path("data") / corpus_stem(corpus.name)
    check_output_folder(out)  # before the lock makes the folder, and before a tokenizer is trained and saved there
    with folder_lock(out, "prepare"):
        shards, seconds = _prepare_locked(args, corpus, out)
    verb = "reused" if shards.reused else f"wrote in {seconds:.1f}s"
    print(f"{verb}: token shards in {out}")
    for split in ("train", "val"):
        m = shards.meta["splits"][split]
        print(f"  {split:>5}: {m['documents']:>6} documents {m['tokens']:>11,} tokens {m['bytes']:>12,} bytes "
              f"({m['bytes'] / max(m['tokens'], 1):.2f} bytes/token)")
    return 0


def _prepare_locked(args: argparse.Namespace, corpus, out: Path):
    """The tokenizer (given, reused or trained) and the shards, while this process holds ``out``'s lock;
    returns the shards and the seconds writing them took."""
    from tinylm.data.shards import prepare
    from tinylm.tokenizers import load_tokenizer

    if args.tokenizer:
        tok = load_tokenizer(args.tokenizer)
    else:
        # No tokenizer given: train one on the corpus, or reuse the one trained here last time.
        tok_path = out / "tokenizer.json"
        if tok_path.exists() and not args.force:
            tok = load_tokenizer(tok_path)
            print(f"reusing the tokenizer in {tok_path} (pass --force to train a new one)")
        else:
            start = time.perf_counter()
            tok = train_tokenizer_from(args, corpus)
            tok.save(tok_path)
            print(f"trained a {tok.kind} tokenizer with |V| = {tok.vocab_size} in {time.perf_counter() - start:.1f}s: "
                  f"{tok_path}")
    start = time.perf_counter()
    shards = prepare(
        corpus, tok, out, val_fraction=args.val_fraction, seed=args.seed, workers=args.workers,
        progress=sys.stderr.isatty(), overwrite=args.force,
    )
    return shards, time.perf_counter() - start


def add_commands(sub: argparse._SubParsersAction) -> None:
    """tinylm prepare."""
    # tinylm prepare
    p = sub.add_parser("prepare", help="tokenize a corpus into train/validation token shards",
                       description="Tokenize a corpus into binary token shards (numpy memmaps) with a "
                       "deterministic train/validation split by document and EOS between documents. "
                       "Without --tokenizer, trains one on the corpus first. Running it again on the "
                       "same inputs reuses the result.")
    add_corpus_flags(p)
    p.add_argument("--tokenizer", help="a tinylm tokenizer JSON file (default: train one, see --kind)")
    add_tokenizer_training_flags(p, vocab_default=4096)
    p.add_argument("--out", help="output folder (default: data/CORPUS)")
    p.add_argument("--val-fraction", type=fraction, default=0.1, help="share of documents for validation (default: 0.1)")
    p.add_argument("--seed", type=seed_int, default=0, help="seed of the train/validation split (default: 0)")
    p.add_argument("--force", action="store_true", help="re-train the tokenizer and rewrite the shards")
    p.set_defaults(func=cmd_prepare, parser=p)
