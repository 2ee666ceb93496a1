"""`tinylm eval` and `tinylm compare`: loss, perplexity and bits per byte of trained runs."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tinylm.cli.flags import (add_command, add_corpus_flags, add_run_flags, add_threads_flag, integer, load_corpus_from,
                              positive_int)
from tinylm.errors import TinyLMError

STRIDE_HELP = (
    "sliding windows: a window of block_size tokens every S tokens, scoring only the targets no window before it "
    "scored (1 <= S <= block_size), so each target is scored once with at least block_size - S + 1 tokens of "
    "context; costs about block_size / S times more (default: disjoint windows, the same as S = block_size). An "
    "LSTM or RNN restarts its state in each window, so it gains context too; an n-gram model reads its own "
    "context whatever S. With --tokens: evenly spaced windows of S scored targets each")


BENCHMARKS = "mc:cloze, mc:next-line, mc:speaker, icl:mapping, icl:copy, or a JSONL file of items"
TASK_HELP = (
    "instead of the loss, score a task. Benchmark tasks, as lm-evaluation-harness scores them: multiple choice by "
    "each choice's log-likelihood (accuracy, and accuracy_norm per byte of the choice), generation by exact match "
    "of the greedy answer; built in: mc:cloze (a blanked word of a held-out Shakespeare line, 4 choices), "
    "mc:next-line (the line that follows, of 4), mc:speaker (who says the line, of 4 characters), icl:mapping "
    "(made-up words to colours, a new mapping per item shown only by the examples: 0-shot is chance), icl:copy "
    "(repeat made-up words, generation); or a JSONL file, one item a line: {\"context\", \"choices\", \"answer\"} "
    "or {\"prompt\", \"answer\", \"stop\"}. Chat tasks, asked as chats and scored by exact match of the reply: "
    "tasks:add, tasks:add+spell, ..., or a JSONL file of conversations, each asked up to its last (assistant's) "
    "message, the answer")
SHOTS_HELP = ("with a benchmark --task: solved examples before each question, from the task's train split "
              "(NAME.train.jsonl beside a task file), each followed by a blank line; several, e.g. 0,1,2,4,8, print "
              "the in-context learning curve (default: 0). With --harness: one number, the harness's num_fewshot "
              "(default: each task's own)")


def _shots(text: str) -> list[int]:
    """'0,1,2,4,8' -> [0, 1, 2, 4, 8]: numbers of shots, each 0 or more, in increasing order."""
    try:
        values = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        values = []
    if not values or values[0] < 0:
        raise argparse.ArgumentTypeError(f"expected whole numbers of 0 or more separated by commas (0,1,2,4,8), "
                                         f"got {text!r}")
    return values


def _add_benchmark_flags(p: argparse.ArgumentParser) -> None:
    """--shots, --seed and --train-file: how a benchmark task's few-shot prompts are made (eval and compare)."""
    from tinylm.task_eval import SHOT_SEED

    p.add_argument("--shots", type=_shots, metavar="K[,K...]", help=SHOTS_HELP)
    p.add_argument("--seed", type=integer, default=SHOT_SEED, help="picks each question's shots (default: "
                   f"{SHOT_SEED})")
    p.add_argument("--train-file", metavar="FILE", help="a task file's train split, where the shots come from "
                   "(default: NAME.train.jsonl beside NAME.jsonl)")


def _to_stderr(line: str) -> None:
    print(f"tinylm: {line}", file=sys.stderr)


def _device(setting: str) -> str:
    """--device as the library takes it: "auto" resolved to the GPU when there is one, else the CPU."""
    from tinylm.device import resolve_device

    return str(resolve_device(setting))


def cmd_eval(args: argparse.Namespace) -> int:
    """Evaluate a trained run (Transformer, LSTM, RNN or n-gram) on a split of the token shards it was trained on,
    or on any corpus: mean loss per token, perplexity, bits per byte of the original text, the tokens and bytes
    counted, and the time it took. A network reads the text in disjoint windows of its block_size unless --stride
    slides them. With --task, score a task instead: a benchmark (mc:cloze, icl:mapping, a JSONL file of multiple-
    choice or generation items) as lm-evaluation-harness scores it, at each number of --shots; or chat tasks
    (tasks:add), asked as chats."""
    from tinylm.evaluate import evaluate_run

    run = args.run_flag or args.run
    if run is None:
        raise TinyLMError("give the run to evaluate: tinylm eval --run DIR (a run folder or an n-gram .npz file)")
    if args.run_flag and args.run and args.run_flag != args.run:
        raise TinyLMError("give the run once, with --run or as the argument, not both")
    if args.quant is not None and (args.task is not None or args.harness is not None):
        raise TinyLMError("--quant goes with the loss evaluation (no --task or --harness): it measures what int8 "
                          "weights cost in loss and bits per byte")
    if args.task is not None:
        return _eval_tasks(args, run)
    if args.harness is not None:
        return _eval_harness(args, run)
    result = evaluate_run(run, args.split, checkpoint=args.checkpoint, max_tokens=args.tokens or 0, quant=args.quant,
                          stride=args.stride, batch_size=args.batch_size, data_dir=args.data_dir,
                          corpus=load_corpus_from(args), tokenizer=args.tokenizer, device=_device(args.device),
                          progress=sys.stderr.isatty(), threads=args.threads, log=_to_stderr)
    if args.json:
        print(json.dumps({"run": str(run), **({"quant": args.quant} if args.quant else {}), **result.report()}))
        return 0
    scope = "bytes prorated from a subset" if result.prorated else "all of it"
    where = f"the corpus {args.corpus}" if args.corpus else f"the {args.split} split"
    weights = " with int8 weights" if args.quant else ""
    print(f"{run}{weights} on {where} ({result.describe_windows()}): loss {result.loss:.4f} nats per token, "
          f"perplexity {result.perplexity:.2f}, {result.bits_per_byte:.4f} bits per byte")
    print(f"  {result.tokens:,} tokens, {result.bytes:,.0f} bytes ({scope}), {result.seconds:.1f} s")
    if result.unknown_tokens:
        print(f"  {result.unknown_tokens:,} of the tokens are <unk>, standing for {result.unknown_bytes:,.0f} bytes the "
              "tokenizer cannot spell; bits per byte charges them 8 bits each")
    return 0


def _eval_tasks(args: argparse.Namespace, run: str) -> int:
    """`tinylm eval --task`: exact match on built-in tasks' held-out items, and how many replies ended their turn."""
    from tinylm.task_eval import evaluate_run_tasks, is_chat_task

    if not is_chat_task(args.task):
        return _eval_benchmark(args, run)
    if args.shots is not None or args.train_file is not None or args.plot is not None:
        raise TinyLMError(f"--shots, --train-file and --plot are for benchmark tasks ({BENCHMARKS}); {args.task} is "
                          "asked as chats")

    scores = evaluate_run_tasks(run, args.task, items=args.items, checkpoint=args.checkpoint,
                                device=_device(args.device), threads=args.threads, log=_to_stderr)
    if args.json:
        print(json.dumps({"run": str(run), "tasks": [s.as_dict() for s in scores]}))
        return 0
    for s in scores:
        name = f"tasks:{s.task}" if args.task.startswith("tasks:") else s.task
        print(f"{run} on {name} ({s.items} held-out items, greedy): exact match {100 * s.accuracy:.1f}%, "
              f"{100 * s.ended_share:.1f}% of replies ended with the end-of-turn token")
        for prompt, answer, reply in s.examples:
            print(f"  {prompt!r} -> {reply!r} (answer {answer!r})")
    return 0


def _eval_harness(args: argparse.Namespace, run: str) -> int:
    """`tinylm eval --harness`: lm-evaluation-harness tasks through `tinylm.harness.TinyLMHarness`."""
    from tinylm.harness import run_harness, results_table

    if args.shots is not None and len(args.shots) > 1:
        raise TinyLMError("--harness takes one number of --shots (the harness's num_fewshot)")
    out = run_harness(run, [t for t in args.harness.split(",") if t], include_path=args.include_path,
                      shots=args.shots[0] if args.shots else None, limit=args.limit, checkpoint=args.checkpoint, device=_device(args.device),
                      batch_size=args.batch_size, threads=args.threads, log=_to_stderr)
    if args.json:
        print(json.dumps({"run": str(run), "tasks": out["results"], "n-shot": out["n-shot"]}, default=float))
        return 0
    print(results_table(out))
    return 0


def _eval_benchmark(args: argparse.Namespace, run: str) -> int:
    """`tinylm eval --task mc:cloze` (or a task file): accuracy at each number of --shots, and its curve."""
    from tinylm.compare import TaskCurve, check_plot_path, plot_task_curves
    from tinylm.run import read_run_info
    from tinylm.task_eval import evaluate_run_task, format_task_results

    if args.plot is not None:
        check_plot_path(args.plot)
    results = evaluate_run_task(run, args.task, shots=args.shots or [0], items=args.items, seed=args.seed,
                                train_file=args.train_file, checkpoint=args.checkpoint, device=_device(args.device),
                                threads=args.threads, log=_to_stderr)
    if args.json:
        for r in results:
            print(json.dumps({"run": str(run), **r.as_dict()}))
    else:
        print(format_task_results(str(run), results))
    if args.plot is not None:
        family = read_run_info(run).get("family", "gpt")
        chart = plot_task_curves([TaskCurve(Path(run).name, family, results)], args.plot)
        print(f"chart: {chart}", file=sys.stderr if args.json else sys.stdout)
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    """Evaluate runs of any family and tokenizer (n-gram, RNN, LSTM, Transformer) on their validation split, or all
    on one --corpus, and print a table sorted by bits per byte, the measure that is fair across tokenizers; draw the
    bits per byte as a bar chart (PNG). With --task, score every run on a benchmark task instead, at each number
    of --shots: a table of accuracies, and with --plot the in-context learning curves (accuracy against shots,
    chance dashed)."""
    from tinylm.compare import check_plot_path, compare_runs, format_table, plot_comparison

    if args.task is not None:
        return _compare_task(args)
    if args.shots is not None or args.train_file is not None:
        raise TinyLMError("--shots and --train-file go with --task")
    # beside the runs (runs/compare.png), where git ignores it as it ignores the runs, not in the working folder
    plot = args.plot if args.plot is not None else str(Path(args.runs[0]).parent / "compare.png")
    check_plot_path(plot)
    rows = compare_runs(args.runs, split=args.split, corpus=load_corpus_from(args), max_tokens=args.tokens or 0,
                        stride=args.stride, device=_device(args.device), threads=args.threads, log=_to_stderr)
    chart = plot_comparison(rows, plot)
    if args.json:
        print(json.dumps({"chart": str(chart), "runs": [
            {"run": r.name, "family": r.family, "size": r.size, "tokenizer": r.tokenizer, **r.result.report()}
            for r in sorted(rows, key=lambda r: r.result.bits_per_byte)]}))
        return 0
    print(format_table(rows))
    print(f"chart: {chart}")
    return 0


def _compare_task(args: argparse.Namespace) -> int:
    """`tinylm compare --task`: the runs' accuracy on a benchmark task at each number of shots; --plot, the curves."""
    from tinylm.compare import check_plot_path, compare_task, format_task_table, plot_task_curves

    plot = args.plot
    if plot is not None:
        check_plot_path(plot)
    curves = compare_task(args.runs, args.task, shots=args.shots or [0], items=args.items, seed=args.seed,
                          train_file=args.train_file, device=_device(args.device), threads=args.threads,
                          log=_to_stderr)
    chart = plot_task_curves(curves, plot) if plot is not None else None
    if args.json:
        print(json.dumps({"chart": None if chart is None else str(chart), "runs": [
            {"run": c.name, "family": c.family, "results": [r.as_dict() for r in c.results]} for c in curves]}))
        return 0
    print(format_task_table(curves))
    if chart is not None:
        print(f"chart: {chart}")
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    """tinylm eval and tinylm compare."""
    p = add_command(sub, "eval", cmd_eval, "loss, perplexity and bits per byte of a trained run (any model family)")
    p.add_argument("run", nargs="?", help=argparse.SUPPRESS)
    add_run_flags(p, "the run folder (e.g. runs/tiny-shakespeare), or an n-gram model file (.npz)", dest="run_flag",
                  required=False)
    p.add_argument("--split", choices=["val", "train"], default="val", help="which split (default: val)")
    add_corpus_flags(p, default=None, what="evaluate on this corpus instead of a split, tokenized with the run's "
                      "tokenizer:")
    p.add_argument("--tokenizer", help="for an n-gram .npz file: the tokenizer JSON it was counted with")
    p.add_argument("--tokens", type=positive_int, help="evaluate evenly spaced windows of about this many tokens "
                   "(default: the whole split; an n-gram model always scores all of it, in seconds)")
    p.add_argument("--stride", type=integer, metavar="S", help=STRIDE_HELP)
    p.add_argument("--batch-size", type=positive_int, help="windows per forward pass (default: about 1024 tokens' "
                   "worth, the fastest on a CPU)")
    p.add_argument("--data-dir", help="the run's shard folder, if it has moved since training")
    p.add_argument("--device", default="auto", help="auto (cuda when there is a GPU, else cpu), cpu, cuda, cuda:N "
                   "or mps (default: auto, as for train)")
    p.add_argument("--task", metavar="TASK", help=TASK_HELP)
    p.add_argument("--items", type=positive_int, default=200, help="with --task: items per task (default: 200)")
    _add_benchmark_flags(p)
    p.add_argument("--plot", metavar="FILE.png", help="with a benchmark --task: draw accuracy against --shots")
    p.add_argument("--harness", metavar="TASKS", help="instead of the loss: lm-evaluation-harness tasks, "
                   "comma-separated (pip install -e \".[harness]\"); your own task YAMLs are found with --include-path")
    p.add_argument("--include-path", metavar="DIR", help="with --harness: a folder of task YAMLs of your own "
                   "(e.g. examples/harness)")
    p.add_argument("--limit", type=positive_int, metavar="N", help="with --harness: the first N items of each task")
    p.add_argument("--quant", choices=["int8"],
                   help="evaluate the model as `tinylm sample --quant int8` decodes it: its block matrices and head "
                   "stored as int8 with one scale per row, to see what int8 costs in loss (GPT runs on a CPU only; "
                   "default: float32)")
    p.add_argument("--json", action="store_true", help="print the numbers as one JSON object (for scripts)")
    add_threads_flag(p)

    p = add_command(sub, "compare", cmd_compare, "evaluate several runs on the same text: a table and a bar chart")
    p.add_argument("runs", nargs="+", metavar="RUN", help="run folders")
    p.add_argument("--split", choices=["val", "train"], default="val", help="which split (default: val)")
    add_corpus_flags(p, default=None, what="evaluate every run on this corpus instead of its split:")
    p.add_argument("--tokens", type=positive_int, help="evaluate about this many tokens per network "
                   "(default: all; n-gram models always score all)")
    p.add_argument("--stride", type=integer, metavar="S", help=STRIDE_HELP)
    p.add_argument("--plot", metavar="PATH", help="the bar chart (default: compare.png in the first run's parent "
                   "folder, e.g. runs/compare.png); with --task, accuracy against --shots, one line per run")
    p.add_argument("--task", metavar="TASK", help=f"instead of bits per byte: every run on a benchmark task "
                   f"({BENCHMARKS}), at each number of --shots")
    p.add_argument("--items", type=positive_int, default=200, help="with --task: test items (default: 200)")
    _add_benchmark_flags(p)
    p.add_argument("--device", default="auto", help="auto (cuda when there is a GPU, else cpu), cpu, cuda, cuda:N "
                   "or mps (default: auto, as for train)")
    p.add_argument("--json", action="store_true", help="print the table as JSON, best first (the chart is still "
                   "written)")
    add_threads_flag(p)
