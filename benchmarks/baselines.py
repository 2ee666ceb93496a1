"""Benchmark: the baselines of the lectures, measured on one text with one tokenizer and one split.

Run from the repository root::

    python benchmarks/baselines.py                         # Shakespeare, BPE 4096, n-gram orders 1..6, nltk
    python benchmarks/baselines.py --max-order 5 --no-nltk
    python benchmarks/baselines.py --no-nltk --budget-tokens 500000     # shorter neural runs
    python benchmarks/baselines.py --nltk-train-tokens 50000 --nltk-val-tokens 1000

Everything shares one tokenizer (byte-level BPE, GPT-4 split pattern, trained here on the whole
corpus: ``--vocab-size``) and one split (`tinylm.data.prepare`, 10% of the plays for validation),
and every model is scored in bits per byte of the validation text, which does not depend on the
tokenizer. Two tables are printed:

1. **n-gram models on the full training split**: interpolated modified Kneser-Ney for orders
   1..``--max-order``, with the time to count ("build") and to score the whole validation split,
   and its loss, perplexity and bits per byte; the best order is marked. For the lectures' point
   about smoothing, the best order's counts are also scored as pure MLE (infinite: validation text
   has n-grams training never saw) and as add-k.
2. **tinylm against nltk.lm.KneserNeyInterpolated**, which is far too slow for the full corpus
   (every lower-order probability scans every n-gram type in Python), so both sides get the same
   subset: the first ``--nltk-train-tokens`` training tokens and the first ``--nltk-val-tokens``
   validation tokens, at order ``--nltk-order``, fed to nltk as the everygrams of the same padded
   documents (ids written as strings, since nltk's vocabulary takes strings). tinylm runs nltk's
   formulation (``smoothing="kn-nltk"``: one discount 0.1, a unigram level with no uniform part,
   nltk's padding counts); the speed ratio compares build + score, and the perplexity is over
   the targets nltk gives a non-zero probability (a token never seen in nltk's training subset
   gets probability 0 there, and in tinylm's copy of it). A row with tinylm's own modified KN on the
   same subset shows what the proper formulation gives on all targets.

Table 1 also has the neural models on the same shards, each trained by the same loop
(`tinylm.train.train`) for the same number of training tokens (``--budget-tokens``, the default
`tinylm train`'s 1.5M): the `rnn` preset (a plain tanh RNN, 2 x 256 at lr 1e-2), the `lstm` preset
(2 x 256 at lr 1e-2; ``--lstm-layers``, ``--lstm-width`` and ``--lstm-lr`` override it), both with
backpropagation through the whole 128-token window, and the Transformer with the `classic` preset's
recipe (AdamW, cosine) and with the `tiny` preset's (Muon, warmup-stable-decay, ...; the default
run uses |V| 8192, here it gets this table's tokenizer like every row, so its figure is not the
default run's: `benchmarks/recipe.py` measures that). Their "build" is the training time; they are
scored on the whole validation split. ``--no-neural`` leaves them out.

nltk is not a tinylm dependency: ``pip install nltk`` to get table 2 (it is skipped otherwise).
This is a measurement, not a test.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import re
import tempfile
import tracemalloc
from dataclasses import dataclass
from typing import Any

import numpy as np

from timing import median_seconds

from tinylm.data import ShardSet, load_corpus, prepare
from tinylm.model.ngram import NGramModel
from tinylm.tokenizers import Tokenizer, train_bpe


@dataclass
class Row:
    """One model's line in a table: what it is, how long it took, and how well it predicts."""

    model: str  # family and implementation, e.g. "tinylm n-gram"
    formulation: str  # the smoothing or architecture, in words
    size: str  # order, or parameter count
    train_tokens: int
    build_s: float  # counting or training time
    eval_s: float  # scoring time
    eval_tokens: int
    loss: float  # nats per token
    bpb: float  # bits per byte
    note: str = ""

    @property
    def perplexity(self) -> float:
        return math.inf if self.loss > 700 else math.exp(self.loss)


def print_table(title: str, rows: list[Row], best: Row | None = None) -> None:
    print(f"\n{title}")
    head = f"{'model':<16} {'formulation':<36} {'size':<8} {'train tok':>10} {'build s':>8} {'eval s':>8} " \
           f"{'eval tok':>9} {'loss':>7} {'ppl':>9} {'bpb':>7}  note"
    print(head)
    print("-" * len(head))
    for r in rows:
        mark = " *" if r is best else ""
        print(f"{r.model:<16} {r.formulation:<36} {r.size:<8} {r.train_tokens:>10,} {r.build_s:>8.3f} {r.eval_s:>8.3f} "
              f"{r.eval_tokens:>9,} {r.loss:>7.4f} {r.perplexity:>9.2f} {r.bpb:>7.4f}{mark}  {r.note}")


def text_bytes(tok: Tokenizer, ids: np.ndarray) -> int:
    """UTF-8 bytes of the text that ``ids`` stand for (special tokens stand for none)."""
    lengths = np.array([0 if tok.is_special(i) else len(tok.token_bytes(i)) for i in range(tok.vocab_size)])
    return int(lengths[ids].sum())


# ----- table 1: n-gram models on the full split -------------------------------------------------------


def ngram_rows(shards: ShardSet, max_order: int, add_k: float) -> tuple[list[Row], Row]:
    """Modified-KN n-gram models of orders 1..max_order, then MLE and add-k at the best order."""
    val = shards.tokens("val")
    n_train = shards.num_tokens("train")
    rows: list[Row] = []
    models: dict[int, NGramModel] = {}
    for order in range(1, max_order + 1):
        tracemalloc.start()  # numpy reports its allocations to tracemalloc: the peak is the build's working set
        build_s, model = median_seconds(lambda: NGramModel.fit_shards(shards, order, smoothing="kn"))
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        eval_s, result = median_seconds(lambda: model.evaluate_shards(shards, "val"))
        D = ", ".join(f"{d:.2f}" for d in model.discounts[-1])
        note = f"model {model.nbytes / 2**20:.0f} MB, build peak {peak / 2**20:.0f} MB; top D1,D2,D3+ {D}"
        rows.append(Row("tinylm n-gram", "interpolated modified Kneser-Ney", f"n={order}", n_train, build_s, eval_s,
                        result.tokens, result.loss, result.bits_per_byte, note))
        models[order] = model
    best = min(rows, key=lambda r: r.bpb)
    best_order = int(best.size.removeprefix("n="))
    with tempfile.TemporaryDirectory() as tmp:  # the saved file (deflated .npz) beside the in-memory size
        save_s, path = median_seconds(lambda: models[best_order].save(f"{tmp}/best.npz"))
        best.note += f"; saved as {path.stat().st_size / 2**20:.0f} MB .npz in {save_s:.1f} s"
    for smoothing, kw, words in [("mle", {}, "maximum likelihood (no smoothing)"),
                                 ("add-k", {"k": add_k}, f"add-k, k = {add_k:g}")]:
        model = models[best_order].with_smoothing(smoothing, **kw)
        eval_s, result = median_seconds(lambda: model.evaluate_shards(shards, "val"))
        unseen = int(np.isinf(model.score(val)).sum())
        note = (f"{unseen:,} validation {'token gets' if unseen == 1 else 'tokens get'} p = 0" if unseen
                else "same counts, rescored")
        rows.append(Row("tinylm n-gram", words, f"n={best_order}", n_train, 0.0, eval_s, result.tokens,
                        result.loss, result.bits_per_byte, note))
    return rows, best


def neural_rows(shards: ShardSet, tok: Tokenizer, corpus: str, folder: str, budget: int,
                lstm: dict[str, Any]) -> list[Row]:
    """The rnn, lstm and tiny presets, trained by `tinylm.train.train` for ``budget`` tokens on these shards.

    ``lstm``: settings that override the lstm preset's model (n_layer, d_model, lr).
    """
    from tinylm.config import resolve_config
    from tinylm.evaluate import evaluate_model, split_text
    from tinylm.run import load_run
    from tinylm.train import train

    tok_path = f"{folder}/tokenizer.json"
    tok.save(tok_path)
    common = {"corpus": corpus, "tokenizer": tok_path, "data_dir": str(shards.path), "max_tokens": budget,
              "sample_tokens": 0, "eval_interval": 10**9}
    rows = []
    for name, preset, overrides in [("tinylm RNN", "rnn", {}), ("tinylm LSTM", "lstm", lstm),
                                    ("tinylm GPT", "classic", {}), ("tinylm GPT", "tiny", {})]:
        config = resolve_config(preset=preset, overrides={**common, **overrides})
        out = f"{folder}/{preset}"
        lines: list[str] = []
        result = train(config, out, progress=False, log=lines.append)
        run = load_run(out)
        val = evaluate_model(run.model, split_text(shards, "val"), run.tokenizer,
                             block_size=run.config.model.block_size, batch_size=run.config.train.batch_size)
        mc = run.config.model
        shape = f"{mc.n_layer} x {mc.d_model}, lr {config.train.lr:g}"
        words = f"{mc.family.upper()} {shape}" if mc.family in ("lstm", "rnn") else f"{preset} preset: {shape}"
        n_params = sum(p.numel() for p in {id(p): p for p in run.model.parameters()}.values())
        threads = next((m.group(1) for m in map(re.compile(r"(\d+) CPU threads?").search, lines) if m), "?")
        plural = "" if threads == "1" else "s"
        speed = f"{result.tokens / result.elapsed:,.0f} tok/s training on {threads} thread{plural}"
        rows.append(Row(name, words, f"{n_params / 1e6:.2f}M", result.tokens, result.elapsed, val.seconds,
                        val.tokens, val.loss, val.bits_per_byte, speed))
    return rows


# ----- table 2: tinylm against nltk on a subset ------------------------------------------------------


def split_documents(stream: np.ndarray, eos_id: int) -> list[np.ndarray]:
    """Cut an EOS-separated stream into documents (each keeps its EOS; a cut-off last one has none)."""
    ends = np.flatnonzero(stream == eos_id) + 1
    return [d for d in np.split(stream, ends) if len(d)]


def nltk_rows(shards: ShardSet, tok: Tokenizer, order: int, n_train: int, n_val: int) -> list[Row]:
    from nltk.lm import KneserNeyInterpolated
    from nltk.util import everygrams

    bos, eos = tok.bos_id, tok.eos_id
    train = np.asarray(shards.tokens("train")[:n_train], dtype=np.int64)
    val = np.asarray(shards.tokens("val")[:n_val], dtype=np.int64)
    val_bytes = text_bytes(tok, val)
    subset = f"first {len(train):,} train / {len(val):,} val tokens"

    # tinylm, nltk's formulation: build, then score; each the median of 5 runs (they take milliseconds)
    build_s, model = median_seconds(lambda: NGramModel.fit(train, order, tokenizer=tok, smoothing="kn-nltk"), repeats=5)
    score_s, ours_logp = median_seconds(lambda: model.score(val), repeats=5)
    ours_s = build_s + score_s

    # nltk: the everygrams of the same padded documents; the vocabulary is every id in them
    def nltk_build() -> Any:
        padded = [[str(t) for t in [bos] * (order - 1) + d.tolist()] for d in split_documents(train, eos)]
        lm = KneserNeyInterpolated(order)  # discount 0.1
        lm.fit([everygrams(p, max_len=order) for p in padded], [t for p in padded for t in p])
        return lm

    def nltk_score(lm: Any) -> np.ndarray:
        probs = []
        for doc in split_documents(val, eos):
            p = [str(t) for t in [bos] * (order - 1) + doc.tolist()]
            probs += [lm.score(p[i], tuple(p[i - order + 1 : i])) for i in range(order - 1, len(p))]
        return np.array(probs)

    print(f"\nnltk: fitting KneserNeyInterpolated(order={order}) on {len(train):,} tokens and scoring "
          f"{len(val):,}, one token at a time ...", flush=True)
    nltk_build_s, lm = median_seconds(nltk_build)
    nltk_score_s, nltk_p = median_seconds(lambda: nltk_score(lm))

    # perplexity over the targets nltk can score (p > 0); tinylm's copy gives 0 on exactly the same ones
    ours_p = np.exp(ours_logp)
    seen = nltk_p > 0
    same_zeros = bool(np.array_equal(seen, ours_p > 0))
    max_rel = float(np.max(np.abs(ours_p[seen] / nltk_p[seen] - 1)))
    nats = {"tinylm": -float(ours_logp[seen].sum()), "nltk": -float(np.log(nltk_p[seen]).sum())}
    kept_bytes = val_bytes * seen.sum() / len(val)  # prorated: bytes of the scored targets' share
    note = f"{(~seen).sum()} of {len(val)} targets p=0 (unseen token), left out"
    formulation = "nltk KN: 1 discount 0.1, no uniform"
    rows = [
        Row("tinylm n-gram", formulation, f"n={order}", len(train), build_s, score_s, int(seen.sum()),
            nats["tinylm"] / seen.sum(), nats["tinylm"] / (kept_bytes * math.log(2)), note),
        Row("nltk.lm", formulation, f"n={order}", len(train), nltk_build_s, nltk_score_s, int(seen.sum()),
            nats["nltk"] / seen.sum(), nats["nltk"] / (kept_bytes * math.log(2)), note),
    ]
    # tinylm's own formulation on the same subset: every target, finite
    kn_s, kn = median_seconds(lambda: NGramModel.fit(train, order, tokenizer=tok, smoothing="kn"))
    kn_score_s, r = median_seconds(lambda: kn.evaluate(val, val_bytes))
    rows.append(Row("tinylm n-gram", "interpolated modified Kneser-Ney", f"n={order}", len(train), kn_s, kn_score_s,
                    r.tokens, r.loss, r.bits_per_byte, "all targets (unseen tokens via the uniform part)"))
    print_table(f"2. tinylm vs nltk.lm on a subset ({subset}), same ids, same padded documents", rows)

    speedup = (nltk_build_s + nltk_score_s) / ours_s
    ppl_gap = abs(math.exp(nats["tinylm"] / seen.sum()) / math.exp(nats["nltk"] / seen.sum()) - 1)
    print(f"\nbuild + score: tinylm {ours_s * 1e3:.1f} ms, nltk {nltk_build_s + nltk_score_s:.1f} s: "
          f"{speedup:,.0f}x faster (target >= 20x: {'met' if speedup >= 20 else 'MISSED'})")
    print(f"build only: tinylm {build_s * 1e3:.1f} ms, nltk {nltk_build_s:.2f} s ({nltk_build_s / build_s:,.0f}x); "
          f"score only: tinylm {score_s * 1e3:.2f} ms, nltk {nltk_score_s:.2f} s ({nltk_score_s / score_s:,.0f}x)")
    print(f"perplexity agreement: {ppl_gap:.2e} relative (target <= 1%: {'met' if ppl_gap <= 0.01 else 'MISSED'}); "
          f"largest per-token probability difference {max_rel:.1e} relative; "
          f"zero-probability targets identical: {same_zeros}")
    return rows


# ----- putting it together --------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", default="shakespeare", help="a built-in corpus or a path (default: shakespeare)")
    parser.add_argument("--vocab-size", type=int, default=4096, help="BPE vocabulary size, specials included")
    parser.add_argument("--max-order", type=int, default=6, help="n-gram orders 1..N on the full split")
    parser.add_argument("--add-k", type=float, default=0.01, help="k for the add-k row")
    parser.add_argument("--no-nltk", action="store_true", help="skip the comparison with nltk")
    parser.add_argument("--no-neural", action="store_true", help="leave the RNN, LSTM and Transformer rows out")
    parser.add_argument("--budget-tokens", type=int, default=1_500_000, help="training tokens for each neural model")
    parser.add_argument("--lstm-layers", type=int, help="override the lstm preset's 2 layers")
    parser.add_argument("--lstm-width", type=int, help="override the lstm preset's width 256")
    parser.add_argument("--lstm-lr", type=float, help="override the lstm preset's peak learning rate 1e-2")
    parser.add_argument("--nltk-order", type=int, default=3)
    parser.add_argument("--nltk-train-tokens", type=int, default=100_000)
    parser.add_argument("--nltk-val-tokens", type=int, default=2_000)
    args = parser.parse_args(argv)

    corpus = load_corpus(args.corpus)
    texts = list(corpus.texts())
    bpe_s, tok = median_seconds(lambda: train_bpe(texts, vocab_size=args.vocab_size, pattern="gpt4"))
    with tempfile.TemporaryDirectory() as tmp:
        prep_s, shards = median_seconds(lambda: prepare(corpus, tok, tmp))
        split = shards.meta["splits"]
        assert text_bytes(tok, np.asarray(shards.tokens("val"))) == split["val"]["bytes"]  # bytes agree with prepare
        print(f"corpus {args.corpus}: {len(texts)} documents; tokenizer: byte-level BPE, GPT-4 pattern, "
              f"|V| = {tok.vocab_size} (trained in {bpe_s:.1f} s); shards in {prep_s:.1f} s")
        for name in ("train", "val"):
            s = split[name]
            print(f"  {name}: {s['documents']} documents, {s['tokens']:,} tokens, {s['bytes']:,} bytes "
                  f"({s['bytes'] / s['tokens']:.2f} bytes/token)")

        rows, best = ngram_rows(shards, args.max_order, args.add_k)
        if not args.no_neural:
            rows += neural_rows(shards, tok, args.corpus, tmp, args.budget_tokens, {
                k: v for k, v in (("n_layer", args.lstm_layers), ("d_model", args.lstm_width), ("lr", args.lstm_lr))
                if v is not None})
        title = ("1. n-gram, RNN, LSTM and Transformer on the full split: bits per byte of the validation text "
                 "(* best n-gram order)")
        print_table(title, rows, best)

        if args.no_nltk:
            return
        if importlib.util.find_spec("nltk") is None:
            print("\n2. skipped: nltk is not installed (pip install nltk)")
            return
        nltk_rows(shards, tok, args.nltk_order, args.nltk_train_tokens, args.nltk_val_tokens)


if __name__ == "__main__":
    main()
