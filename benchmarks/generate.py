"""Benchmark: tinylm's generation engine next to Hugging Face `transformers` `generate`, on the CPU.

Run from the repository root::

    python benchmarks/generate.py                       # GPT-2 124M shape and the tiny shape, float32
    python benchmarks/generate.py --shapes tiny --repeats 5 --threads 1
    python benchmarks/generate.py --run runs/tiny-shakespeare --threads 1 --repeats 5 --new-tokens 110 --prompt-tokens 16

With ``--run``, a trained run's held-out prompts (its validation split) instead of random shapes:
tinylm's engine as it was (the model's own forward over a KVCache), its decoding layout, compiled,
speculative decoding with the n-gram and prompt-lookup drafts (drafts kept, model passes),
`transformers` `generate` on the run exported to Hugging Face, and llama.cpp (`llama-cpp-python`)
on the run exported to GGUF f32 and q8_0, all in one process, with how many greedy tokens each
shares with tinylm's engine.

Random shapes (the default):

What is measured, each as the median of ``--repeats`` runs taken in turns (a, b, c, a, b, c, ...)
so that a change in machine load hits every contender alike:

- decode tokens/s at batch 1: a 16-token prompt, 128 new tokens, greedy, EOS ignored; new tokens
  divided by the wall time of the whole call (prefill included), for
  * tinylm's engine (`tinylm.generate.engine.Engine`), as it was (the model's forward over a KVCache),
    with its decoding layout (`tinylm.generate.fast`) and compiled,
  * tinylm without a cache (`tinylm.generate.reference.reference_generate`: every step runs the
    whole sequence again),
  * `transformers` `GPT2LMHeadModel.generate` with ``use_cache=True`` and ``use_cache=False``;
- the same at batch 8 (eight 16-token prompts), with the cache;
- the memory-bandwidth bound. At batch 1 a decoding step is a chain of matrix-vector products:
  every weight is read once per token (the tied embedding once, as the output layer; one row
  of each embedding table is negligible) plus the cached keys and values. So

      tokens/s <= copy bandwidth / (weight bytes + average cache bytes per step)

  where the copy bandwidth is measured here by timing ``dst.copy_(src)`` on a 256 MB tensor
  (counted as bytes read + bytes written, STREAM's convention). The fraction of this bound
  that a decoder reaches says how much of the time goes to anything but streaming weights.

Both models have the same shape and the same weights (tinylm's, converted by `tinylm.export.weights`),
and the benchmark prints how many of the first 32 greedy tokens they agree on before timing them.
The tinylm model uses the GPT-2 choices: learned positions, LayerNorm, GELU (tanh), biases, tied
embeddings. "tiny" is the tiny preset's dimensions (4 layers, d = 192, 6 heads, block 256,
|V| = 2048) with those choices.

This is a measurement, not a test.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from timing import alternating

from tinylm.config import GPTConfig
from tinylm.export.hf import hf_config
from tinylm.export.weights import convert_to_theirs, hf_rules
from tinylm.generate.engine import Engine
from tinylm.generate.reference import reference_generate
from tinylm.generate.sampling import SamplingParams
from tinylm.model import GPT

SHAPES = {
    "gpt2-124m": GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, d_model=768, n_head=12),
    "tiny": GPTConfig(vocab_size=2048, block_size=256, n_layer=4, d_model=192, n_head=6),
}


# ----- the models ----------------------------------------------------------------------------------


def build_pair(config: GPTConfig, seed: int = 0):
    """A tinylm GPT with GPT-2's choices and a Hugging Face GPT2LMHeadModel holding the same weights.

    The weights go across with tinylm's own exporter rules (`tinylm.export.weights`), as `tinylm export`
    would write them.
    """
    from transformers import GPT2Config, GPT2LMHeadModel

    config = dataclasses.replace(config, positions="learned", norm="layernorm", mlp="gelu", bias=True,
                                 tie_embeddings=True, norm_position="pre", dropout=0.0, attention="sdpa")
    torch.manual_seed(seed)
    ours = GPT(config).eval()
    theirs = GPT2LMHeadModel(GPT2Config(**hf_config(config))).eval()
    missing, unexpected = theirs.load_state_dict(convert_to_theirs(ours.state_dict(), hf_rules(config)), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)  # the head is tied to wte
    return ours, theirs


# ----- the contenders ----------------------------------------------------------------------------------


def tinylm_generate(model: GPT, prompts: torch.Tensor, new_tokens: int, compile: bool = False,
                    model_forward: bool = False) -> list[list[int]]:
    """The engine's greedy tokens; ``model_forward``: the engine as it was before its decoding layout (the
    model's own forward over a KVCache, `tinylm.generate.steps.CachedDecoder`)."""
    import tinylm.generate.engine as engine_module
    from tinylm.generate.steps import CachedDecoder

    params = SamplingParams(max_new_tokens=new_tokens, temperature=0, stop_ids=[])
    original = engine_module.make_decoder
    if model_forward:
        engine_module.make_decoder = lambda model, batch, capacity, compile=False: CachedDecoder(model, batch, capacity)
    try:
        return [c.token_ids for c in Engine(model, params, compile=compile).generate(prompts.tolist())]
    finally:
        engine_module.make_decoder = original


def tinylm_no_cache(model: GPT, prompts: torch.Tensor, new_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0, stop_ids=[])
    return [c.token_ids for c in reference_generate(model, prompts.tolist(), params)]


def hf_generate(model, prompts: torch.Tensor, new_tokens: int, use_cache: bool = True) -> list[list[int]]:
    with torch.inference_mode():
        out = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, use_cache=use_cache, pad_token_id=0)
    return out[:, prompts.size(1):].tolist()


# ----- measuring ------------------------------------------------------------------------------------------


def copy_bandwidth(n_bytes: int = 256 * 2**20, repeats: int = 9) -> float:
    """Bytes per second of ``dst.copy_(src)``, counting the bytes read and the bytes written (STREAM's copy)."""
    src = torch.ones(n_bytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch the pages once
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return 2 * n_bytes / statistics.median(times)


def bytes_per_token(model: GPT, prompt_len: int, new_tokens: int) -> float:
    """Bytes one decoding step reads, averaged over the generation: every weight once, plus the cache.

    The learned position table is left out (one row is read). The cache holds, per layer, keys and
    values of n_kv_head * head_dim numbers per position.
    """
    cfg = model.config
    element = next(model.parameters()).element_size()
    weights = sum(p.numel() for p in model.parameters()) - model.pos_emb.P.weight.numel()
    avg_len = prompt_len + (new_tokens - 1) / 2
    cache = 2 * cfg.n_layer * cfg.kv_heads * cfg.head_dim * avg_len
    return (weights + cache) * element


Row = tuple[str, str, float, float | None, float | None]  # shape, decoder, tokens/s, vs transformers, of bound


def bench_shape(name: str, config: GPTConfig, args: argparse.Namespace) -> list[Row]:
    """Rows (shape, decoder, tokens/s, ratio to transformers in the same setting, fraction of the bound)."""
    ours, theirs = build_pair(config)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, config.vocab_size, (1, args.prompt_tokens), generator=g)
    batch = torch.randint(0, config.vocab_size, (args.batch, args.prompt_tokens), generator=g)
    n = args.new_tokens

    # the same computation: tinylm and transformers agree on the greedy tokens (checked on a short run)
    check = min(n, 32)
    a, b = tinylm_generate(ours, prompt, check), hf_generate(theirs, prompt, check)
    agree = next((i for i, (x, y) in enumerate(zip(a[0], b[0])) if x != y), check)
    print(f"{name}: tinylm and transformers agree on {agree} of the first {check} greedy tokens")

    # name -> (function, rows per call, the transformers contender it is compared with)
    B = args.batch
    contenders: dict[str, tuple[Callable[[], object], int, str]] = {
        "tinylm, model forward + KV cache (before)": (lambda: tinylm_generate(ours, prompt, n, model_forward=True), 1,
                                                      "transformers, KV cache"),
        "tinylm engine": (lambda: tinylm_generate(ours, prompt, n), 1, "transformers, KV cache"),
        "tinylm engine, --compile": (lambda: tinylm_generate(ours, prompt, n, compile=True), 1,
                                     "transformers, KV cache"),
        "transformers, KV cache": (lambda: hf_generate(theirs, prompt, n), 1, "transformers, KV cache"),
        f"tinylm engine, batch {B}": (lambda: tinylm_generate(ours, batch, n), B,
                                         f"transformers, KV cache, batch {B}"),
        f"transformers, KV cache, batch {B}": (lambda: hf_generate(theirs, batch, n), B,
                                               f"transformers, KV cache, batch {B}"),
    }
    if not args.skip_no_cache:
        contenders["tinylm, no cache"] = (lambda: tinylm_no_cache(ours, prompt, n), 1, "transformers, no cache")
        contenders["transformers, no cache"] = (lambda: hf_generate(theirs, prompt, n, use_cache=False), 1,
                                                "transformers, no cache")
    for fn, _, _ in contenders.values():
        fn()  # warm up: first calls allocate, load kernels, fill caches
    bandwidths = [copy_bandwidth()]
    seconds = {label: t for label, (t, _) in alternating({label: c[0] for label, c in contenders.items()}, args.repeats).items()}
    bandwidths.append(copy_bandwidth())
    bound = statistics.mean(bandwidths) / bytes_per_token(ours, args.prompt_tokens, n)  # tokens/s at batch 1

    rows = []
    for label, (_, rows_per_call, baseline) in contenders.items():
        tps = rows_per_call * n / seconds[label]
        ratio = seconds[baseline] / seconds[label]
        fraction = tps / bound if rows_per_call == 1 and "no cache" not in label else None
        rows.append((name, label, tps, ratio, fraction))
    rows.append((name, f"bandwidth bound, batch 1 ({statistics.mean(bandwidths) / 1e9:.1f} GB/s)", bound, None, 1.0))
    return rows


# ----- a trained run: tinylm's decoders, speculative decoding, transformers and llama.cpp side by side -----


def held_out_prompts(run, count: int, length: int) -> list[list[int]]:
    """``count`` prompts of ``length`` tokens from the run's validation split (text it did not train on)."""
    from tinylm.data.shards import ShardSet

    val = ShardSet.open(run.info["data"]["dir"]).tokens("val")
    step = len(val) // (count + 1)
    return [[int(t) for t in val[(i + 1) * step:(i + 1) * step + length]] for i in range(count)]


def bench_run(args: argparse.Namespace) -> None:
    """The table for ``--run``: every contender generates ``--new-tokens`` greedy tokens after each held-out prompt."""
    import tempfile

    from transformers import AutoModelForCausalLM

    from tinylm.export import export_run
    from tinylm.generate.speculative import load_draft, speculative_generate
    from tinylm.run import load_run

    run = load_run(args.run)
    n = args.new_tokens
    prompts = held_out_prompts(run, args.prompts, args.prompt_tokens)
    greedy = SamplingParams(max_new_tokens=n, temperature=0, stop_ids=[])
    folder = Path(tempfile.mkdtemp(prefix="tinylm-bench-"))
    export_run(args.run, folder / "hf", "hf")
    theirs = AutoModelForCausalLM.from_pretrained(folder / "hf", dtype=torch.float32).eval()
    ggufs = {}
    for quant in ("f32", "q8_0"):
        ggufs[quant] = export_run(args.run, folder / f"m-{quant}.gguf", "gguf", dtype=quant)

    def engine(compile: bool = False, model_forward: bool = False):
        return lambda: [tinylm_generate(run.model, torch.tensor([p]), n, compile, model_forward)[0] for p in prompts]

    stats = {}

    def speculative(kind: str, compile: bool = False):
        draft = load_draft(kind, run, log=print)

        def go():
            outs, totals = [], [0, 0, 0]
            for p in prompts:
                c, st = speculative_generate(run.model, p, greedy, draft, k=args.k, compile=compile)
                outs.append(c.token_ids)
                totals = [totals[0] + st.accepted, totals[1] + st.proposed, totals[2] + st.forward_passes]
            stats[(kind, compile)] = totals
            return outs
        return go

    def transformers_generate():
        outs = []
        with torch.inference_mode():
            for p in prompts:
                ids = torch.tensor([p])
                out = theirs.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                      do_sample=False, pad_token_id=0)
                outs.append(out[0, len(p):].tolist())
        return outs

    def llama_cpp(quant: str):
        from llama_cpp import Llama

        llm = Llama(model_path=str(ggufs[quant]), n_ctx=run.model.config.block_size, n_batch=run.model.config.block_size,
                    n_threads=torch.get_num_threads(), type_k=0, type_v=0, verbose=False)

        def go():
            outs = []
            for p in prompts:
                out = []
                for token in llm.generate(p, top_k=1, temp=0.0, reset=True):
                    out.append(int(token))
                    if len(out) == n:
                        break
                outs.append(out)
            return outs
        return go

    contenders = {
        "tinylm, model forward + KV cache (before)": engine(model_forward=True),
        "tinylm engine": engine(),
        "tinylm engine, --compile": engine(compile=True),
        "tinylm --draft ngram": speculative("ngram"),
        "tinylm --draft ngram --compile": speculative("ngram", compile=True),
        "tinylm --draft prompt": speculative("prompt"),
        "tinylm --draft prompt --compile": speculative("prompt", compile=True),
        "transformers generate": transformers_generate,
        "llama.cpp f32": llama_cpp("f32"),
        "llama.cpp q8_0": llama_cpp("q8_0"),
    }
    for fn in contenders.values():
        fn()  # warm up: compile, fill caches, count the n-gram draft
    timed = alternating(contenders, args.repeats)
    reference = timed["tinylm engine"][1]
    base = {name: timed[name][0] for name in ("transformers generate", "llama.cpp f32",
                                               "tinylm, model forward + KV cache (before)")}
    total = n * len(prompts)
    print(f"{args.run}: {len(prompts)} held-out prompts of {args.prompt_tokens} tokens, {n} new tokens each, greedy, "
          f"batch 1, {torch.get_num_threads()} thread(s), median of {args.repeats} interleaved runs")
    print()
    print("| decoder | tokens/s | vs before | vs transformers | vs llama.cpp f32 | same greedy tokens | drafts kept |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, (seconds, outs) in timed.items():
        same = sum(a == b for out, ref in zip(outs, reference) for a, b in zip(out, ref))
        kept = next((f"{a} of {b} ({100 * a / max(b, 1):.0f}%), {c} passes" for (kind, comp), (a, b, c) in stats.items()
                     if name == f"tinylm --draft {kind}" + (" --compile" if comp else "")), "-")
        print(f"| {name} | {total / seconds:.0f} | {base['tinylm, model forward + KV cache (before)'] / seconds:.2f}x "
              f"| {base['transformers generate'] / seconds:.2f}x | {base['llama.cpp f32'] / seconds:.2f}x "
              f"| {same}/{total} | {kept} |")


# ----- int8 weights (--quant int8) beside llama.cpp f32 and q8_0 ----------------------------------------------


def make_gpt2_shaped_run(base_run: str, out: str, steps: int, batch: int, length: int, lr: float) -> None:
    """A run folder with GPT-2 124M's shape and choices, trained ``steps`` steps on ``base_run``'s training split.

    There are no GPT-2 weights offline, so this stands in for them: the same matrices (12 x 768, the 50257-row
    tied head; ``base_run``'s tokenizer uses the first ids of it), with a trained, peaked next-token
    distribution instead of a random model's nearly flat one.
    """
    from tinylm.config import Config, TrainConfig, dump_toml
    from tinylm.data.shards import ShardSet
    from tinylm.run import checkpoint_path, load_run, save_checkpoint, write_run_info

    run = load_run(base_run)
    config = dataclasses.replace(SHAPES["gpt2-124m"], positions="learned", norm="layernorm", mlp="gelu", bias=True,
                                 tie_embeddings=True, norm_position="pre", dropout=0.0, attention="sdpa")
    torch.manual_seed(0)
    model = GPT(config)
    train = torch.from_numpy(ShardSet.open(run.info["data"]["dir"]).tokens("train").astype("int64"))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    started = time.perf_counter()
    for step in range(steps):
        starts = torch.randint(0, len(train) - length - 1, (batch,))
        rows = torch.stack([train[s:s + length + 1] for s in starts])  # (batch, length + 1)
        _, loss = model(rows[:, :-1], rows[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        print(f"step {step + 1}/{steps}: loss {loss.item():.3f} ({time.perf_counter() - started:.0f} s)", flush=True)
    folder = Path(out)
    full = Config(config, TrainConfig())
    save_checkpoint(checkpoint_path(folder, "best"), model_state=model.state_dict(), optimizer_state=None,
                    rng_state={}, state={"step": steps}, config=full, tokenizer=run.tokenizer)
    (folder / "config.toml").write_text(dump_toml(full.to_dict()), encoding="utf-8")
    write_run_info(folder, {"status": "complete", "data": run.info["data"]})
    print(f"wrote {folder}")


def int8_quality(run, qmodel, prompts: list[list[int]], new_tokens: int, llama_q8=None, eval_tokens: int = 8192):
    """How close int8 stays to float32: greedy tokens shared, logits' relative error, perplexity on the val split."""
    from tinylm.data.shards import ShardSet
    from tinylm.evaluate import evaluate_model, split_text

    greedy = SamplingParams(max_new_tokens=new_tokens, temperature=0, stop_ids=[])
    ours = [c.token_ids for c in Engine(run.model, greedy).generate(prompts)]
    theirs = [c.token_ids for c in Engine(qmodel, greedy).generate(prompts)]
    shared = sum(a == b for x, y in zip(ours, theirs) for a, b in zip(x, y))
    print(f"greedy tokens int8 shares with float32: {shared}/{len(prompts) * new_tokens} "
          f"({100 * shared / (len(prompts) * new_tokens):.1f}%) over {len(prompts)} held-out prompts")
    # teacher-forced: along float32's greedy path, how often int8's argmax is float32's next token (one early
    # near-tie flipped makes every later free-running token differ, which the count above cannot tell)
    picked = 0
    with torch.inference_mode():
        for p, out in zip(prompts, ours):
            path = torch.tensor([p + out])
            picked += (qmodel(path)[0][0, len(p) - 1:-1].argmax(-1) == path[0, len(p):]).sum().item()
    print(f"int8's argmax along float32's greedy path (teacher-forced): {picked}/{len(prompts) * new_tokens} "
          f"({100 * picked / (len(prompts) * new_tokens):.1f}%)")
    if llama_q8 is not None:
        q8 = llama_q8(prompts, new_tokens)
        same = sum(a == b for x, y in zip(ours, q8) for a, b in zip(x, y))
        print(f"greedy tokens llama.cpp q8_0 shares with tinylm float32: {same}/{len(prompts) * new_tokens} "
              f"({100 * same / (len(prompts) * new_tokens):.1f}%)")
    window = torch.tensor([sum(prompts, [])[: run.model.config.block_size]])
    with torch.inference_mode():
        a, b = run.model(window)[0], qmodel(window)[0]
    print(f"logits over {window.size(1)} held-out positions: relative L2 error {((b - a).norm() / a.norm()).item():.4f}, "
          f"max |diff| {(b - a).abs().max().item():.3f} (logits' std {a.std().item():.2f}), "
          f"argmax shared {(a.argmax(-1) == b.argmax(-1)).float().mean().item():.1%}")
    text = split_text(ShardSet.open(run.info["data"]["dir"]), "val")
    block = run.model.config.block_size
    ppl = {name: evaluate_model(m, text, run.tokenizer, block_size=block, max_tokens=eval_tokens,
                                start_id=run.start_ids[-1] if run.start_ids else None).perplexity
           for name, m in (("float32", run.model), ("int8", qmodel))}
    print(f"perplexity on the first {eval_tokens} val tokens: float32 {ppl['float32']:.3f}, int8 {ppl['int8']:.3f} "
          f"({100 * (ppl['int8'] / ppl['float32'] - 1):+.2f}%)")


def bench_int8(args: argparse.Namespace) -> None:
    """``--int8``: time per token (between ``--short`` and ``--long`` new tokens) of tinylm float32, tinylm int8
    and llama.cpp f32 and q8_0 at batch 1, at each ``--thread-counts``, in one process, taking turns."""
    import tempfile

    from tinylm.export import export_run
    from tinylm.generate.fast import GREEDY_TOKENS, decode_weights
    from tinylm.model.quant import chosen_kernels, int8_bytes, quantized_copy
    from tinylm.run import load_run

    run = load_run(args.run)
    qmodel = quantized_copy(run.model)
    # its own decoding layout, whose run-ahead choice the table overrides (only the --compile rows use it)
    ahead_model = copy.deepcopy(run.model) if args.compile else None
    prompts = held_out_prompts(run, args.prompts, args.prompt_tokens)
    folder = Path(tempfile.mkdtemp(prefix="tinylm-bench-"))
    ggufs = {quant: export_run(args.run, folder / f"m-{quant}.gguf", "gguf", dtype=quant) for quant in ("f32", "q8_0")}
    cfg = run.model.config
    floats = sum(p.numel() for p in run.model.parameters()) * 4
    print(f"{args.run}: {cfg.n_layer} layers, d = {cfg.d_model}, |V| = {cfg.vocab_size}; float32 weights "
          f"{floats / 2**20:.0f} MiB, int8 matrices {int8_bytes(qmodel) / 2**20:.0f} MiB (+ the float embeddings); "
          f"torch {torch.__version__}, {os.cpu_count()} cores, os.nice {os.nice(0)}")

    def llama(quant: str, threads: int):
        from llama_cpp import Llama

        return Llama(model_path=str(ggufs[quant]), n_ctx=cfg.block_size, n_batch=cfg.block_size, n_threads=threads,
                     n_threads_batch=threads, type_k=0, type_v=0, verbose=False)

    def llama_tokens(llm, prompt: list[int], n: int) -> list[int]:
        out = []
        for token in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
            out.append(int(token))
            if len(out) == n:
                return out
        return out

    def engine(model, n: int, compile: bool = False):
        params = SamplingParams(max_new_tokens=n, temperature=0, stop_ids=[])
        return lambda: Engine(model, params, compile=compile).generate([prompts[0]])[0].token_ids

    rows = []
    for threads in args.thread_counts:
        torch.set_num_threads(threads)
        llms = {quant: llama(quant, threads) for quant in ("f32", "q8_0")}
        makers = {
            "tinylm float32": lambda n: engine(run.model, n),
            "tinylm --quant int8": lambda n: engine(qmodel, n),
            "llama.cpp f32": lambda n: (lambda: llama_tokens(llms["f32"], prompts[0], n)),
            "llama.cpp q8_0": lambda n: (lambda: llama_tokens(llms["q8_0"], prompts[0], n)),
        }
        if args.compile:
            makers["tinylm float32 --compile, 1 token a call"] = lambda n: engine(run.model, n, compile=True)
            makers[f"tinylm float32 --compile, {GREEDY_TOKENS} tokens a call"] = lambda n: engine(ahead_model, n,
                                                                                               compile=True)
            makers["tinylm --quant int8 --compile"] = lambda n: engine(qmodel, n, compile=True)
        fns = {(name, n): make(n) for name, make in makers.items() for n in (args.short, args.long)}
        for fn in fns.values():
            fn()  # warm up: kernels measured and chosen, compiled steps made, caches filled
        if args.compile:  # float32: one token a call, and several, whatever the decoder measured (int8: as measured)
            for model, together in ((run.model, False), (ahead_model, True)):
                ahead = decode_weights(model, compiled=True).ahead_faster
                print(f"{GREEDY_TOKENS} greedy tokens a call measured faster than one: {list(ahead.values())}")
                for key in ahead:
                    ahead[key] = together
        timed = alternating(fns, args.repeats)
        per_token = {name: (timed[(name, args.long)][0] - timed[(name, args.short)][0]) / (args.long - args.short)
                     for name in makers}
        for name, seconds in per_token.items():
            rows.append((threads, name, seconds, per_token["llama.cpp q8_0"] / seconds,
                         per_token["tinylm float32"] / seconds))
        del llms
    print(f"batch 1, a {args.prompt_tokens}-token held-out prompt, greedy; time per token = (T({args.long}) - "
          f"T({args.short})) / {args.long - args.short}, T the median of {args.repeats} interleaved runs")
    print("int8 kernels chosen (shape, one row, threads): "
          + ", ".join(f"{k[0][1]}->{k[0][0]}{' x1' if k[1] else ' xN'} t{k[2]}: {v}" for k, v in chosen_kernels().items()))
    print()
    print("| threads | decoder | ms/token | tokens/s | vs llama.cpp q8_0 | vs tinylm float32 |")
    print("|---:|---|---:|---:|---:|---:|")
    for threads, name, seconds, vs_q8, vs_float in rows:
        print(f"| {threads} | {name} | {1000 * seconds:.2f} | {1 / seconds:.0f} | {vs_q8:.2f}x | {vs_float:.2f}x |")
    print()
    if args.measured_threads:
        bench_measured_threads(args, run, qmodel, prompts[0])
    q8 = llama("q8_0", args.thread_counts[-1])
    int8_quality(run, qmodel, prompts, args.quality_tokens,
                 llama_q8=lambda ps, n: [llama_tokens(q8, p, n) for p in ps], eval_tokens=args.eval_tokens)


def bench_measured_threads(args: argparse.Namespace, run, qmodel, prompt: list[int]) -> None:
    """``--measured-threads``: each tinylm decoder at each of ``--thread-counts`` and with the setting it measures
    itself (`tinylm.generate.threads`: what a command without --threads does), taking turns, in one `use_threads`
    block with the command's own count."""
    import tinylm.generate.fast as fast
    from tinylm import device
    from tinylm.generate.fast import decode_weights

    decoders = {"float32": (run.model, False), "int8": (qmodel, False)}
    if args.compile:
        decoders.update({"float32 --compile": (run.model, True), "int8 --compile": (qmodel, True)})
    with device.use_threads("cpu", log=lambda line: print(f"  {line}")) as choice:

        def engine(model, compile: bool, n: int, threads: int | None):  # threads None: measured
            params = SamplingParams(max_new_tokens=n, temperature=0, stop_ids=[])

            def go():
                fast.CHOOSE_THREADS = threads is None
                if threads is not None:
                    torch.set_num_threads(threads)
                    device.pin_threads(None)
                return Engine(model, params, compile=compile).generate([prompt])[0].token_ids

            return go

        counts = [*args.thread_counts, None]
        fns = {(name, t, n): engine(model, compile, n, t) for name, (model, compile) in decoders.items()
               for t in counts for n in (args.short, args.long)}
        for fn in fns.values():
            fn()
        timed = alternating(fns, args.repeats)
    fast.CHOOSE_THREADS = True
    print(f"the command's count: {choice.threads}; measured settings: "
          + "; ".join(f"{name}: {settings[1].describe() if settings else None}" for name, (model, compile) in
                      decoders.items() for key, settings in decode_weights(model).thread_settings.items()
                      if key[1] == compile))
    print()
    print("| decoder | " + " | ".join(f"{t} thread{'s' if t > 1 else ''}" for t in args.thread_counts)
          + " | measured | measured vs the best fixed count |")
    print("|---|" + "---:|" * (len(args.thread_counts) + 2))
    for name in decoders:
        ms = {t: 1000 * (timed[(name, t, args.long)][0] - timed[(name, t, args.short)][0]) / (args.long - args.short)
              for t in counts}
        best = min(ms[t] for t in args.thread_counts)
        print(f"| {name} | " + " | ".join(f"{ms[t]:.2f}" for t in counts) + f" | {best / ms[None]:.2f}x |")
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="gpt2-124m,tiny", help="comma-separated: " + ", ".join(SHAPES))
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds per contender (median)")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--skip-no-cache", action="store_true", help="skip the slow recompute-everything runs")
    parser.add_argument("--run", metavar="DIR", help="a trained run: compare decoders on it instead of random shapes")
    parser.add_argument("--prompts", type=int, default=3, help="with --run: held-out prompts (default 3)")
    parser.add_argument("--k", type=int, default=4, help="with --run: the most drafts per pass (default 4)")
    parser.add_argument("--int8", action="store_true",
                        help="with --run: --quant int8 beside tinylm float32 and llama.cpp f32 and q8_0 (time per "
                        "token, greedy agreement, logits, perplexity)")
    parser.add_argument("--thread-counts", type=lambda t: [int(x) for x in t.split(",")], default=[1, 2],
                        help="with --int8: the thread counts to time (default 1,2)")
    parser.add_argument("--short", type=int, default=8, help="with --int8: the shorter generation (default 8)")
    parser.add_argument("--long", type=int, default=248, help="with --int8: the longer generation (default 248)")
    parser.add_argument("--quality-tokens", type=int, default=100,
                        help="with --int8: greedy tokens per prompt compared with float32 (default 100)")
    parser.add_argument("--compile", action="store_true", help="with --int8: also the compiled steps (float32 and int8)")
    parser.add_argument("--measured-threads", action="store_true",
                        help="with --int8: each tinylm decoder at each --thread-counts and with the thread setting "
                        "it measures itself, as a command without --threads does")
    parser.add_argument("--eval-tokens", type=int, default=8192,
                        help="with --int8: val tokens the perplexities are measured on (default 8192)")
    parser.add_argument("--make-gpt2-run", metavar="DIR",
                        help="write a run with GPT-2 124M's shape, trained briefly on --run's data, and stop")
    parser.add_argument("--train-steps", type=int, default=30, help="with --make-gpt2-run (default 30)")
    parser.add_argument("--train-batch", type=int, default=8, help="with --make-gpt2-run (default 8)")
    parser.add_argument("--train-length", type=int, default=128, help="with --make-gpt2-run (default 128)")
    parser.add_argument("--train-lr", type=float, default=1e-3, help="with --make-gpt2-run (default 1e-3)")
    args = parser.parse_args()
    if args.make_gpt2_run:
        make_gpt2_shaped_run(args.run, args.make_gpt2_run, args.train_steps, args.train_batch, args.train_length,
                             args.train_lr)
        return
    if args.run and args.int8:
        bench_int8(args)
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers

    if args.run:
        transformers.logging.set_verbosity_error()
        bench_run(args)
        return

    transformers.logging.set_verbosity_error()  # its config complains about GPT-2's EOS id in a small vocabulary
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.get_num_threads()} threads, "
          f"{os.cpu_count()} cores; float32; prompt {args.prompt_tokens} tokens, {args.new_tokens} new, greedy; "
          f"median of {args.repeats} interleaved runs")
    rows = []
    for name in args.shapes.split(","):
        rows += bench_shape(name, SHAPES[name], args)
    print()
    print("| shape | decoder | tokens/s | vs transformers | of bandwidth bound |")
    print("|---|---|---:|---:|---:|")
    for shape, label, tps, ratio, fraction in rows:
        r = f"{ratio:.2f}x" if ratio is not None else "-"
        f = f"{fraction:.0%}" if fraction is not None else "-"
        print(f"| {shape} | {label} | {tps:.1f} | {r} | {f} |")


if __name__ == "__main__":
    main()
