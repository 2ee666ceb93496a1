"""Benchmark and check on a CUDA GPU: generation and training of the GPT-2 124M shape, in one run.

Run from the repository root on a machine with a CUDA GPU::

    python benchmarks/gpu.py                 # every check, about two minutes on one GPU
    python benchmarks/gpu.py --quick         # fewer steps and tokens

What it does, each part printing one line or a small table and failing loudly if a check fails:

1. **Generation.** A random GPT-2 124M-shaped model (float32 weights) generates 128 greedy tokens
   at batch 1 and batch 8 through the engine, eager and ``compile=True``; the two must give the
   same tokens, and the compiled engine's tokens/s are printed with the eager ones. Speculative
   decoding (a prompt-lookup draft on a repetitive prompt) must give the engine's greedy tokens.
2. **Attention kernels.** bf16 causal attention at T = 1024 through ``F.scaled_dot_product_attention``
   with only the flash backend allowed (`torch.nn.attention.sdpa_kernel`): it must run and match
   the math backend to bf16 rounding.
3. **Training.** The same shape, bf16 autocast, fused AdamW, 8 x 1024 tokens a step, eager and
   `torch.compile`d: ms per step, tokens/s, and MFU against a measured bf16 matmul peak
   (`tinylm.train.cost.matmul_peak`) with the training FLOPs of `tinylm.explain.accounting`.

Everything runs in one process, so a lent GPU's time is spent once; a CPU-only machine gets one
line saying so and exit status 2. This is a measurement and a smoke test, not part of the suite.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import torch
import torch.nn.functional as F

from tinylm.config import GPTConfig
from tinylm.explain.accounting import flops_per_token
from tinylm.generate.engine import Engine
from tinylm.generate.sampling import SamplingParams
from tinylm.generate.speculative import PromptLookupDraft, speculative_generate
from tinylm.model import GPT
from tinylm.train.cost import matmul_peak

SHAPE = GPTConfig(vocab_size=50304, block_size=1024, n_layer=12, d_model=768, n_head=12, mlp="gelu",
                  norm="layernorm", positions="learned", bias=True, tie_embeddings=True, attention="sdpa")


def timed(fn, repeats: int) -> tuple[float, object]:
    """Median seconds of ``repeats`` calls (synchronised), and the last result."""
    times, result = [], None
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        result = fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2], result


def check_generation(model: GPT, new_tokens: int, repeats: int) -> None:
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0, stop_ids=[])
    print("generation (greedy, float32 weights):")
    for batch in (1, 8):
        prompts = torch.randint(0, SHAPE.vocab_size, (batch, 32), generator=g).tolist()
        rows = {}
        for compile in (False, True):
            engine = lambda: [c.token_ids for c in Engine(model, params, compile=compile).generate(prompts)]  # noqa: E731
            engine()  # warm up (and compile)
            rows[compile] = timed(engine, repeats)
        assert rows[True][1] == rows[False][1], "the compiled engine's greedy tokens differ from the eager engine's"
        for compile, (seconds, _) in rows.items():
            print(f"  batch {batch}, {'compiled' if compile else 'eager   '}: {batch * new_tokens / seconds:9.0f} tokens/s")
    prompt = [11, 22, 33, 44, 55, 66, 77, 88] * 8
    engine = Engine(model, params).generate([prompt])[0].token_ids
    spec, stats = speculative_generate(model, prompt, params, PromptLookupDraft(), k=4, adaptive=False)
    assert spec.token_ids == engine, "speculative greedy tokens differ from the engine's"
    print(f"  speculative (prompt lookup): same tokens, {stats.accepted} of {stats.proposed} drafts kept")


def check_flash_attention() -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (torch.randn(8, 12, 1024, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        flash = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    with sdpa_kernel(SDPBackend.MATH):
        math_ = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(flash, math_, atol=2e-2, rtol=2e-2)
    print("attention: the flash SDPA kernel runs bf16 causal attention at T = 1024 and matches the math kernel")


def check_training(steps: int) -> None:
    config = dataclasses.replace(SHAPE)
    B, T = 8, config.block_size
    peak = matmul_peak([(B * T, config.d_model, 4 * config.d_model), (B * T, config.d_model, config.vocab_size)],
                       torch.device("cuda"), torch.bfloat16)
    flops = flops_per_token(config, T)
    print(f"training ({B} x {T} tokens a step, bf16 autocast, fused AdamW; bf16 matmul peak {peak / 1e12:.0f} TFLOP/s):")
    for compile in (False, True):
        torch.manual_seed(0)
        model = GPT(config).cuda().train()
        step_model = torch.compile(model) if compile else model
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
        x = torch.randint(0, config.vocab_size, (B, T + 1), device="cuda")

        def step():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                _, loss = step_model(x[:, :-1], x[:, 1:])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return float(loss)

        for _ in range(3):
            step()  # warm up (and compile)
        seconds, loss = timed(step, steps)
        rate = B * T / seconds
        print(f"  {'compiled' if compile else 'eager   '}: {seconds * 1e3:7.1f} ms a step, {rate:9.0f} tokens/s, "
              f"MFU {rate * flops / peak:.0%} (loss {loss:.2f})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer tokens and steps")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA GPU here: this script checks and times the CUDA paths; run it where there is one")
        return 2
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    torch.backends.cuda.matmul.allow_tf32 = True
    model = GPT(SHAPE).cuda().eval()
    check_generation(model, new_tokens=64 if args.quick else 128, repeats=3 if args.quick else 5)
    check_flash_attention()
    check_training(steps=5 if args.quick else 20)
    return 0


if __name__ == "__main__":
    sys.exit(main())
