"""`tinylm prepare`: a corpus to train/validation token shards."""

from __future__ import annotations

import argparse

from tinylm.cli.flags import (add_command, add_corpus_flags, add_tokenizer_training_flags, fraction, load_corpus_from,
                              seed_int)


def cmd_prepare(args: argparse.Namespace) -> int:
    """Tokenize a corpus into binary token shards (numpy memmaps) with a deterministic train/validation split by
    document and EOS between documents. Without --tokenizer, trains one on the corpus first. Running it again on the
    same inputs reuses the result."""
    # `prepare_corpus` takes the flags as given and picks the folder and the tokenizer; printed here: the splits it
    # wrote (or reused)
    from tinylm.data.prepare_run import prepare_corpus

    shards = prepare_corpus(
        load_corpus_from(args), args.out, tokenizer=args.tokenizer, kind=args.kind, vocab_size=args.vocab_size,
        pattern=args.pattern, unknown=args.unknown, n_reserved=args.reserved, val_fraction=args.val_fraction,
        seed=args.seed, workers=args.workers, force=args.force,
    )
    for split in ("train", "val"):
        m = shards.meta["splits"][split]
        print(f"  {split:>5}: {m['documents']:>6} documents {m['tokens']:>11,} tokens {m['bytes']:>12,} bytes "
              f"({m['bytes'] / max(m['tokens'], 1):.2f} bytes/token)")
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    """tinylm prepare."""
    p = add_command(sub, "prepare", cmd_prepare, "tokenize a corpus into train/validation token shards")
    add_corpus_flags(p)
    p.add_argument("--tokenizer", help="a tinylm tokenizer JSON file (default: train one, see --kind)")
    add_tokenizer_training_flags(p, vocab_default=4096)
    p.add_argument("--out", help="output folder (default: data/CORPUS)")
    p.add_argument("--val-fraction", type=fraction, default=0.1, help="share of documents for validation (default: 0.1)")
    p.add_argument("--seed", type=seed_int, default=0, help="seed of the train/validation split (default: 0)")
    p.add_argument("--force", action="store_true", help="re-train the tokenizer and rewrite the shards")
