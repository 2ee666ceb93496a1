"""Benchmark: tinylm's BPE training and encoding next to Hugging Face `tokenizers` and tiktoken.

Run from the repository root::

    python benchmarks/tokenizer.py                      # Shakespeare (tinylm's built-in corpus), vocab 8192
    python benchmarks/tokenizer.py --vocab-size 32768 --corpus books/ --repeats 5

What is measured, each as the median of ``--repeats`` runs on the same documents:

- training: `tinylm.tokenizers.train_bpe` (GPT-4 split pattern) against `tokenizers`'
  ``BpeTrainer`` with a byte-level pre-tokenizer (which splits with the GPT-2 pattern), both
  to the same vocabulary size, three special tokens included, fed the same list of documents
  (``train_from_iterator``). Both use every core.
- encoding, in MB of UTF-8 per second: tinylm's readable reference encoder (on a prefix of the
  corpus when the corpus is large: it is plain Python), tinylm's fast path (`encode` one
  document at a time, and `encode_batch`), and tiktoken itself, an `Encoding` built here from
  the same ranks and called directly, so the ratio is the cost of tinylm's wrapper.

This is a measurement, not a test: it checks only that every encoder gives the same ids.
"""

from __future__ import annotations

import argparse
import os

import tiktoken
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers, trainers

from timing import alternating

from tinylm.data import load_corpus
from tinylm.tokenizers import BPETokenizer, train_bpe
from tinylm.tokenizers.base import special_token_names

REFERENCE_MAX_BYTES = 1_000_000  # the reference encoder does ~0.5 MB/s; more would only make us wait


def train_hf(docs: list[str], vocab_size: int) -> HFTokenizer:
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_token_names(),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer)
    return tok


def plain_tiktoken(tok: BPETokenizer) -> tiktoken.Encoding:
    """tiktoken's own Encoding from our ranks: token bytes -> id, nothing of tinylm in the call path."""
    return tiktoken.Encoding(
        name="benchmark",
        pat_str=tok.pattern,
        mergeable_ranks={tok.token_bytes(i): i for i in range(tok.base_vocab_size)},
        special_tokens={},
    )


def prefix_docs(docs: list[str], max_bytes: int) -> list[str]:
    """The first documents, up to about ``max_bytes`` of UTF-8 (the last one cut short)."""
    out, size = [], 0
    for doc in docs:
        if size >= max_bytes:
            break
        doc = doc[: max_bytes - size]  # characters, so at most ~max_bytes bytes of ASCII text
        out.append(doc)
        size += len(doc.encode("utf-8"))
    return out


def print_table(rows: list[tuple[str, str, str, str]]) -> None:
    """Columns: what, which, the measurement (right-aligned), the ratio."""
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    for what, which, value, ratio in rows:
        print(f"{what:<{widths[0]}}  {which:<{widths[1]}}  {value:>{widths[2]}}  {ratio}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], epilog=__doc__.split("\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--vocab-size", type=int, default=8192, help="total vocabulary, special tokens included (default 8192)")
    parser.add_argument(
        "--corpus",
        "--corpus-dir",
        default="shakespeare",
        help="a built-in corpus name or a text file, folder or .jsonl, as `tinylm.data.load_corpus` reads it "
        "(default: shakespeare)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="runs of each measurement; the median is reported (default 3)")
    args = parser.parse_args(argv)

    docs = list(load_corpus(args.corpus).texts())
    mb = sum(len(doc.encode("utf-8")) for doc in docs) / 1e6
    print(
        f"corpus {args.corpus}: {len(docs)} documents, {mb:.2f} MB; vocab {args.vocab_size}; "
        f"median of {args.repeats} runs; {os.cpu_count()} CPUs"
    )

    training = alternating(
        {"ours": lambda: train_bpe(docs, args.vocab_size, "gpt4"), "hf": lambda: train_hf(docs, args.vocab_size)},
        args.repeats,
    )
    (ours_s, tok), (hf_s, hf_tok) = training["ours"], training["hf"]
    assert tok.vocab_size == hf_tok.get_vocab_size() == args.vocab_size, (tok.vocab_size, hf_tok.get_vocab_size())

    enc = plain_tiktoken(tok)
    ref_docs = prefix_docs(docs, REFERENCE_MAX_BYTES)
    ref_mb = sum(len(doc.encode("utf-8")) for doc in ref_docs) / 1e6
    encoding = alternating(
        {
            "reference": lambda: [tok.encode_reference(doc) for doc in ref_docs],
            "encode": lambda: [tok.encode(doc) for doc in docs],
            "tiktoken": lambda: [enc.encode_ordinary(doc) for doc in docs],
            "encode_batch": lambda: tok.encode_batch(docs, num_threads=8),
            "tiktoken_batch": lambda: enc.encode_ordinary_batch(docs, num_threads=8),
        },
        args.repeats,
    )
    ids = {name: result for name, (_, result) in encoding.items()}
    assert ids["encode"] == ids["encode_batch"] == ids["tiktoken"] == ids["tiktoken_batch"], "the encoders disagree"
    assert ids["reference"] == [enc.encode_ordinary(doc) for doc in ref_docs], "the reference encoder disagrees"
    speed = {name: (ref_mb if name == "reference" else mb) / seconds for name, (seconds, _) in encoding.items()}

    subset = f" (first {ref_mb:.1f} MB)" if ref_mb < mb else ""
    print_table([
        ("training", "tinylm train_bpe (gpt4 pattern)", f"{ours_s:.2f} s", f"{ours_s / hf_s:.2f}x the time of HF"),
        ("training", "HF tokenizers BpeTrainer (ByteLevel)", f"{hf_s:.2f} s", "1.00x"),
        ("encoding", "tinylm encode_reference" + subset, f"{speed['reference']:.2f} MB/s",
         f"{speed['reference'] / speed['tiktoken']:.3f}x tiktoken's speed"),
        ("encoding", "tinylm encode (per document)", f"{speed['encode']:.2f} MB/s",
         f"{speed['encode'] / speed['tiktoken']:.2f}x tiktoken's speed"),
        ("encoding", "tiktoken encode_ordinary (per document)", f"{speed['tiktoken']:.2f} MB/s", "1.00x"),
        ("encoding", "tinylm encode_batch (8 threads)", f"{speed['encode_batch']:.2f} MB/s",
         f"{speed['encode_batch'] / speed['tiktoken_batch']:.2f}x tiktoken's batch speed"),
        ("encoding", "tiktoken encode_ordinary_batch (8 threads)", f"{speed['tiktoken_batch']:.2f} MB/s", "1.00x"),
    ])
    n_tokens = sum(map(len, ids["encode"]))
    print(f"{n_tokens} tokens, {mb * 1e6 / n_tokens:.2f} bytes per token")


if __name__ == "__main__":
    main()
