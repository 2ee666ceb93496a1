"""Benchmark: multiple-choice scoring's tokens per second against `tinylm eval`'s, on a trained run.

Run from the repository root::

    python benchmarks/task_speed.py                                  # runs/tiny-shakespeare, 1 thread
    python benchmarks/task_speed.py --run runs/tiny --items 100 --shots 0,4 --threads 2

`tinylm eval`'s speed is the validation split read in disjoint windows (`tinylm.evaluate.evaluate_model`, its
default batches), ``--tokens`` targets of it. Multiple choice is `tinylm.task_eval.score_task` on the built-in
tasks at each number of ``--shots``: the log-likelihood of every choice after its few-shot prompt
(`tinylm.scoring.loglikelihoods`). Its tokens are what the pairs hold, context plus choice for every choice, as a
scorer reading each pair whole reads them; the Transformer reads each question's context once
(``share_context``), so it can do better than 1x. The second column is the same scoring with every pair read
whole (``share_context=False``), what sharing gains. Each setting is timed ``--repeats`` times, alternating, and
the median printed; the ratio to eval's tokens per second is the figure to watch (the target is at least 0.8).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tinylm.data.mc_tasks import load_task
from tinylm.data.shards import ShardSet
from tinylm.evaluate import evaluate_model, split_text
from tinylm.run import load_run
from tinylm.scoring import encode_pair, loglikelihoods
from tinylm.task_eval import draw_shots, few_shot_prompt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", default="runs/tiny-shakespeare")
    parser.add_argument("--tasks", default="mc:cloze,mc:next-line,mc:speaker,icl:mapping")
    parser.add_argument("--shots", default="0,4")
    parser.add_argument("--items", type=int, default=60)
    parser.add_argument("--tokens", type=int, default=16_384, help="targets of the validation split for eval")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    run = load_run(args.run)
    model, tok, block = run.model, run.tokenizer, run.config.model.block_size
    text = split_text(ShardSet.open(run.info["data"]["dir"]), "val")

    def eval_speed() -> float:
        start = time.perf_counter()
        result = evaluate_model(model, text, tok, block_size=block, max_tokens=args.tokens, start_id=run.start_ids[-1] if run.start_ids else None)
        return result.tokens / (time.perf_counter() - start)

    cases = []
    for name in args.tasks.split(","):
        task = load_task(name, n=args.items)
        for k in (int(s) for s in args.shots.split(",")):
            pairs = [encode_pair(tok, few_shot_prompt(item, draw_shots(task, i, k)), choice, run.start_ids)
                     for i, item in enumerate(task.test) for choice in item.choices]
            cases.append((f"{name} {k}-shot", pairs, sum(len(c) + len(x) for c, x in pairs)))

    def mc_speed(pairs, n_tokens, share) -> float:
        start = time.perf_counter()
        loglikelihoods(model, pairs, share_context=share)
        return n_tokens / (time.perf_counter() - start)

    evals: list[float] = []
    speeds: dict[tuple[str, bool], list[float]] = {}
    for _ in range(args.repeats):
        evals.append(eval_speed())
        for label, pairs, n_tokens in cases:
            for share in (None, False):
                speeds.setdefault((label, share is None), []).append(mc_speed(pairs, n_tokens, share))
    base = statistics.median(evals)
    print(f"{args.run} ({run.family}, block_size {block}), {args.threads} thread(s), {args.items} items a task, "
          f"medians of {args.repeats}")
    print(f"  tinylm eval: {base:,.0f} tokens/s")
    print(f"  {'multiple choice':<22} {'tokens/s':>9} {'x eval':>7}   {'pairs whole':>11} {'x eval':>7}")
    for label, _, _ in cases:
        fast, whole = (statistics.median(speeds[(label, s)]) for s in (True, False))
        print(f"  {label:<22} {fast:>9,.0f} {fast / base:>7.2f}   {whole:>11,.0f} {whole / base:>7.2f}")


if __name__ == "__main__":
    main()
