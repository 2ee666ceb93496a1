"""Benchmark: speculative decoding (a prompt-lookup draft) next to the plain KV-cache engine, batch 1.

Run from the repository root, on a trained run (the README's `tinylm train` makes runs/tiny-shakespeare)::

    python benchmarks/speculative.py --run runs/tiny-shakespeare
    python benchmarks/speculative.py --run runs/tiny-shakespeare --threads 2 --repeats 7 --k 6
    python benchmarks/speculative.py --run runs/tiny-shakespeare --pass-cost

For each prompt and temperature, the engine (`tinylm.generate.engine.Engine`) and `speculative_generate`
with `PromptLookupDraft` generate ``--new-tokens`` tokens from the same prompt with the same seed, taking
turns (`timing.alternating`), and the medians are printed as tokens/s with the ratio, the drafts kept and
the model passes per 100 tokens. At temperature 0 the two must give the same tokens (checked). EOS does
not stop either (every row generates the full count).

``--pass-cost`` prints instead what a speculative round costs against a plain step: the median time of
one pass of the run's decoder (`tinylm.generate.fast.StaticDecoder`, eager) over 1, 2, 3 and k + 1
new tokens after a 10-token context, and each as a multiple of the one-token pass. Drafting can only
pay when tokens per pass beat that multiple.

This is a measurement, not a test.
"""

from __future__ import annotations

import argparse

import torch
from timing import alternating

from tinylm.generate.engine import Engine
from tinylm.generate.fast import StaticDecoder
from tinylm.generate.sampling import SamplingParams
from tinylm.generate.speculative import PromptLookupDraft, speculative_generate
from tinylm.run import load_run

PROMPTS = {"ROMEO": "ROMEO:\n", "repetitive": "To be, or not to be. To be, or not to be. To be, or"}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__.split("\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", required=True, help="a trained run folder")
    parser.add_argument("--new-tokens", type=int, default=100, help="tokens to generate (default 100)")
    parser.add_argument("--k", type=int, default=4, help="the most drafts checked in one pass (default 4)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--repeats", type=int, default=5, help="runs of each; medians are reported (default 5)")
    parser.add_argument("--pass-cost", action="store_true", help="time one decoder pass over 1..k+1 tokens instead")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    run = load_run(args.run)
    if args.pass_cost:
        pass_cost(run, args)
        return
    print(f"{args.run}: batch 1, {args.new_tokens} new tokens, {args.threads} thread(s), k <= {args.k}, "
          f"medians of {args.repeats}")
    print(f"{'prompt':<12}{'T':>5}{'engine tok/s':>14}{'draft tok/s':>13}{'ratio':>8}{'drafts kept':>14}"
          f"{'passes/100':>12}  same tokens")
    for name, text in PROMPTS.items():
        ids = run.start_ids + run.tokenizer.encode(text)
        for temperature in (0.0, 0.8):
            params = SamplingParams(max_new_tokens=args.new_tokens, temperature=temperature, seed=0, stop_ids=[])
            timed = alternating({
                "engine": lambda: Engine(run.model, params).generate([ids])[0],
                "draft": lambda: speculative_generate(run.model, ids, params, PromptLookupDraft(), args.k,
                                                      tokenizer=run.tokenizer),
            }, args.repeats)
            (plain_s, plain), (draft_s, (completion, stats)) = timed["engine"], timed["draft"]
            same = "yes" if completion.token_ids == plain.token_ids else ("no" if temperature == 0 else "-")
            assert temperature > 0 or same == "yes", "greedy speculative output differs from the engine's"
            n = len(completion.token_ids)
            print(f"{name:<12}{temperature:>5.1f}{len(plain.token_ids) / plain_s:>14.0f}{n / draft_s:>13.0f}"
                  f"{plain_s / draft_s:>7.2f}x{f'{stats.accepted} of {stats.proposed}':>14}"
                  f"{100 * stats.forward_passes / max(n, 1):>12.0f}  {same}")


@torch.inference_mode()
def pass_cost(run, args: argparse.Namespace) -> None:
    """Median ms of one eager decoder pass over T new tokens (the pending one and T - 1 drafts), T = 1, 2, 3, k + 1."""
    decoder = StaticDecoder(run.model, 1, run.model.config.block_size, extra=args.k)
    decoder.extend(torch.arange(10)[None])  # a context to attend to
    sizes = sorted({1, 2, 3, args.k + 1})

    def one_pass(T: int):
        def go():
            decoder.extend(torch.arange(T)[None])
            decoder.truncate(10)  # forget them: every pass starts from the same context
        return go

    for fn in map(one_pass, sizes):
        fn()  # warm up
    timed = alternating({T: one_pass(T) for T in sizes}, max(args.repeats, 20))
    print(f"{args.run}: one eager decoder pass after 10 tokens, {args.threads} thread(s), medians of "
          f"{max(args.repeats, 20)}")
    for T in sizes:
        print(f"  {T} token(s): {1e3 * timed[T][0]:6.2f} ms  ({timed[T][0] / timed[1][0]:.2f}x one token)")


if __name__ == "__main__":
    main()
