"""Benchmark: encoding time on whitespace runs of 0.25M to 4M characters, and the exponent of its growth.

Run from the repository root::

    python benchmarks/whitespace.py                 # BPE 4096 trained on Shakespeare, gpt4 pattern
    python benchmarks/whitespace.py --repeats 7 --pattern gpt2

For each kind of run (spaces, tabs, U+3000, and " \\t" alternating) and each length n, the text is
``"word" + run * n + "x"``: the shape that makes tiktoken's split engine panic from about a million
characters on. It is encoded by tinylm's `encode_ordinary` (the median of ``--repeats`` runs) and,
side by side, by tiktoken itself (an `Encoding` from the same ranks) where tiktoken can: below
its panic, and on the same run with nothing after it (``run * n`` alone, which tiktoken's
possessive end-of-text branch splits without backtracking). The exponent k of time ~ n^k is the
least-squares slope of log time against log n; linear is k = 1.

Last, the cost of the hostile-input checks on ordinary text: tinylm's `encode_ordinary` against
tiktoken's on each Shakespeare document (their ratio; the ids must be equal).

This is a measurement, not a test: it checks only that tinylm's ids equal the reference encoder's
on the 0.25M texts and tiktoken's wherever tiktoken answers.
"""

from __future__ import annotations

import argparse
import math
import statistics

from timing import median_seconds

from tinylm.data import load_corpus
from tinylm.tokenizers import train_bpe
from tinylm.tokenizers.bpe import _tiktoken_call
from tinylm.errors import TinyLMError

LENGTHS = [250_000, 500_000, 1_000_000, 2_000_000, 4_000_000]
RUNS = {"spaces": " ", "tabs": "\t", "U+3000": "\u3000", "space-tab": " \t"}


def exponent(lengths: list[int], times: list[float]) -> float:
    xs, ys = [math.log(n) for n in lengths], [math.log(t) for t in times]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--pattern", default="gpt4")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    docs = list(load_corpus("shakespeare").texts())
    tok = train_bpe(docs, args.vocab_size, args.pattern)
    enc = tok.tiktoken_encoding
    print(f"BPE {tok.vocab_size} on Shakespeare, pattern {args.pattern}; medians of {args.repeats}")
    print(f"{'run':>10} {'n':>10} {'tinylm s':>9} {'tiktoken s':>11} {'tiktoken, run alone s':>22}")
    for name, unit in RUNS.items():
        ours = []
        for n in LENGTHS:
            text = "word" + unit * (n // len(unit)) + "x"
            ids = tok.encode_ordinary(text)
            if n == LENGTHS[0]:
                assert ids == tok.encode_reference(text), name
            ours.append(median_seconds(lambda: tok.encode_ordinary(text), args.repeats)[0])
            try:
                theirs_ids = _tiktoken_call(enc.encode_ordinary, text)
                assert theirs_ids == ids, name
                theirs = f"{median_seconds(lambda: enc.encode_ordinary(text), args.repeats)[0]:.3f}"
            except TinyLMError:
                theirs = "panics"
            alone = unit * (n // len(unit))
            assert _tiktoken_call(enc.encode_ordinary, alone) == tok.encode_ordinary(alone), name
            alone_time = median_seconds(lambda: enc.encode_ordinary(alone), args.repeats)[0]
            print(f"{name:>10} {n:>10,} {ours[-1]:>9.3f} {theirs:>11} {alone_time:>22.3f}")
        print(f"{name:>10} exponent of tinylm's time in n: {exponent(LENGTHS, ours):.2f}")

    ours = median_seconds(lambda: [tok.encode_ordinary(d) for d in docs], args.repeats)[0]
    theirs = median_seconds(lambda: [enc.encode_ordinary(d) for d in docs], args.repeats)[0]
    assert [tok.encode_ordinary(d) for d in docs] == [enc.encode_ordinary(d) for d in docs]
    mb = sum(len(d.encode("utf-8")) for d in docs) / 1e6
    print(f"ordinary text ({mb:.1f} MB of Shakespeare, one document at a time): tinylm {ours:.3f} s, "
          f"tiktoken {theirs:.3f} s, ratio {ours / theirs:.2f}")


if __name__ == "__main__":
    main()
