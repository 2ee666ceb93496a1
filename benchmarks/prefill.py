"""Benchmark: prefill (reading a prompt) in tinylm and llama.cpp, and a chat's second turn with the prefix cache.

Run from the repository root::

    python benchmarks/prefill.py --run runs/tiny                 # the default run, 1 and 2 threads
    python benchmarks/prefill.py --run runs/tiny --gpt2 --repeats 3   # and GPT-2 124M's shape (random weights)

Prefill: the time to read a prompt of ``block_size - 1`` held-out tokens (511 on the default run) into an empty
cache and give the last position's logits, for

- tinylm eager: the model's own forward over a `KVCache` (`tinylm.generate.steps.CachedDecoder.start`);
- tinylm fast: the decoding layout (`tinylm.generate.fast.StaticDecoder.start`, what the engine uses for a GPT);
- llama.cpp (`llama-cpp-python`) on the run exported to GGUF f32: ``eval`` of the prompt after a reset.

Second turn: a conversation's first turn read ``--history`` tokens and answered; the second sends them again
with ``--new`` more. Timed is reading that second prompt: recomputed (tinylm fast, ``start``), with tinylm's
prefix cache (`tinylm.generate.prefix_cache.PrefixCache.resume`: the first turn's keys copied in, the new
tokens run), and llama.cpp keeping its own cache of the first turn (its tokens kept, the new ones evaluated).

Every figure is the median of ``--repeats`` runs, contenders taking turns (`timing.alternating`), so a change in
the machine's load hits all alike. With ``--gpt2``, the same on a model of GPT-2 124M's shape (12 x 768,
|V| = 50257, learned positions, LayerNorm, GELU), its weights untrained (timing does not depend on them).
This is a measurement, not a test.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import torch

from generate import held_out_prompts, make_gpt2_shaped_run
from timing import alternating

from tinylm.export import export_run
from tinylm.generate.fast import StaticDecoder
from tinylm.generate.prefix_cache import PrefixCache
from tinylm.generate.steps import CachedDecoder
from tinylm.run import load_run


def llama_for(gguf: Path, context: int, threads: int):
    from llama_cpp import Llama

    return Llama(model_path=str(gguf), n_ctx=context, n_batch=context, n_ubatch=context, n_threads=threads,
                 n_threads_batch=threads, type_k=0, type_v=0, verbose=False)


def llama_prefill(llm, ids: list[int]):
    """llama.cpp reads ``ids`` into an empty cache (its last logits computed)."""
    llm.reset()
    llm.eval(ids)


def llama_resume(llm, ids: list[int], kept: int):
    """llama.cpp keeps its first ``kept`` cached tokens (a previous turn's) and evaluates the rest of ``ids``."""
    llm.n_tokens = kept
    llm.eval(ids[kept:])


def tinylm_prefill(decoder, ids: list[int]):
    idx = torch.tensor([ids])
    with torch.inference_mode():
        return decoder.start(idx, torch.ones_like(idx, dtype=torch.bool))


def tinylm_resume(cache: PrefixCache, decoder, ids: list[int]):
    with torch.inference_mode():
        return cache.resume(decoder, ids)


def bench(name: str, run_dir: str, args: argparse.Namespace, data_run) -> None:
    run = load_run(run_dir)
    model = run.model.eval()
    cfg = model.config
    length = args.prompt_tokens or min(cfg.block_size, 512) - 1
    prompt = held_out_prompts(data_run, 1, length)[0]
    history, new = prompt[:args.history], prompt[args.history:args.history + args.new]
    second = history + new
    folder = Path(tempfile.mkdtemp(prefix="tinylm-prefill-"))
    gguf = export_run(run_dir, folder / "m-f32.gguf", "gguf", dtype="f32")
    context = min(cfg.block_size, 512)
    print(f"\n{name}: {cfg.n_layer} layers, d = {cfg.d_model}, |V| = {cfg.vocab_size}, context {cfg.block_size}; "
          f"prompt {length} tokens; second turn {len(history)} + {len(new)} tokens; torch {torch.__version__}, "
          f"{os.cpu_count()} cores, median of {args.repeats}")
    print("| threads | what | ms | tokens/s | time tinylm / llama.cpp |")
    print("|---:|---|---:|---:|---:|")
    for threads in args.threads:
        torch.set_num_threads(threads)
        llm = llama_for(gguf, context, threads)
        eager = CachedDecoder(model, 1, context)
        fast = StaticDecoder(model, 1, context)
        turn = StaticDecoder(model, 1, context)
        cache = PrefixCache(None)
        tinylm_prefill(turn, history)  # the first turn: its keys and values kept
        cache.remember(turn, 0, history)
        fns = {
            "prefill: tinylm eager": lambda: tinylm_prefill(eager, prompt),
            "prefill: tinylm fast": lambda: tinylm_prefill(fast, prompt),
            "prefill: llama.cpp f32": lambda: llama_prefill(llm, prompt),
        }
        alternating(fns, 1)  # warm up
        timed = alternating(fns, args.repeats)
        llama_prefill(llm, history)  # llama.cpp's first turn
        turns = {
            "second turn: tinylm, recomputed": lambda: tinylm_prefill(turn, second),
            "second turn: tinylm, prefix cache": lambda: tinylm_resume(cache, turn, second),
            "second turn: llama.cpp, its cache kept": lambda: llama_resume(llm, second, len(history)),
        }
        alternating(turns, 1)
        timed.update(alternating(turns, args.repeats))
        reused = tinylm_resume(cache, turn, second)[1]
        assert reused == len(history), reused
        for what, (seconds, _) in timed.items():
            tokens = length if what.startswith("prefill") else (len(new) if "cache" in what else len(second))
            llama = timed["prefill: llama.cpp f32" if what.startswith("prefill")
                          else "second turn: llama.cpp, its cache kept"][0]
            ratio = f"{seconds / llama:.2f}x" if "tinylm" in what else ""
            print(f"| {threads} | {what} | {1000 * seconds:.1f} | {tokens / seconds:.0f} | {ratio} |")
        recomputed, reusing = timed["second turn: tinylm, recomputed"][0], timed["second turn: tinylm, prefix cache"][0]
        print(f"| {threads} | second turn: recomputed / prefix cache | | | {recomputed / reusing:.1f}x faster "
              f"(token ratio {len(second) / len(new):.1f}) |")
        del llm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", default="runs/tiny", help="the trained run (default runs/tiny)")
    parser.add_argument("--threads", type=lambda t: [int(x) for x in t.split(",")], default=[1, 2],
                        help="thread counts (default 1,2)")
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds per contender (median; default 7)")
    parser.add_argument("--prompt-tokens", type=int, default=None, help="default: the context less one (511)")
    parser.add_argument("--history", type=int, default=448, help="the first turn's tokens (default 448)")
    parser.add_argument("--new", type=int, default=48, help="the second turn's new tokens (default 48)")
    parser.add_argument("--gpt2", action="store_true", help="also GPT-2 124M's shape (untrained weights)")
    args = parser.parse_args()
    data_run = load_run(args.run)
    bench(args.run, args.run, args, data_run)
    if args.gpt2:
        folder = Path(tempfile.mkdtemp(prefix="tinylm-gpt2-")) / "run"
        make_gpt2_shaped_run(args.run, str(folder), steps=0, batch=1, length=8, lr=0.0)
        bench("GPT-2 124M shape", str(folder), args, data_run)


if __name__ == "__main__":
    main()
