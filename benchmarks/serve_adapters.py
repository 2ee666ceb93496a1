"""Benchmark: LoRA adapters served beside their base, concurrent requests for two adapters vs the base alone.

Run from the repository root::

    python benchmarks/serve_adapters.py                          # the real `tinylm serve`, over HTTP, on the CPU
    python benchmarks/serve_adapters.py --direct --device cuda   # the scheduler in this process, no HTTP

What is measured: tokens/s of C concurrent clients (C = 8 and 32), each sending ``--requests`` completion
requests one after another (a prompt of a dozen tokens, ``--max-tokens`` new tokens at temperature 1 with a
per-request seed: a random model almost never stops early, so every request does the same work), against

==================  ==============================================================================
``base``            a server of the base alone (no ``--adapter``); every request for the base
``base, stacked``   the same base with two adapters stacked on it; every request still for the base:
                    what carrying adapters costs a batch that uses none
``one adapter``     that server; every request for adapter ``a``
``two adapters``    that server; requests alternate between ``a`` and ``b``, so every batch mixes them
``base + two``      that server; requests go to the base, ``a`` and ``b`` in turn
==================  ==============================================================================

The adapters are rank ``--rank`` on every matrix of every block (the widest LoRA), their B drawn at random
(as after training; zeros would cost the same). The modes are taken in turns, in alternating order, for
each C, ``--repeats`` times, so that a change in machine load hits all alike; reported per row: the median
tokens/s over the repeats and its ratio to ``base`` at the same C.

By default the real server runs (`tinylm serve`, one process per server, PyTorch on ``--threads``
threads) and clients talk HTTP. ``--direct`` drives the `tinylm.serve.scheduler.Scheduler` in this process
instead (one thread per client, no HTTP): the decoding alone, on any ``--device``.

The model is the tiny preset (4 layers, d = 192, 6 heads, RoPE, RMSNorm, SwiGLU; ``--preset`` for another)
with random weights and a byte-level BPE tokenizer of |V| = 4096, as in benchmarks/serve.py, unless ``--run``
names a trained run.

This is a measurement, not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve import CLIENTS, Server, corpus_texts, prompts_from  # noqa: E402

from tinylm.checkpoint import LORA_BASE, load_checkpoint, lora_base_record, save_checkpoint  # noqa: E402
from tinylm.config import Config, TrainConfig, build_config, dump_toml, load_preset  # noqa: E402
from tinylm.generate import SamplingParams  # noqa: E402
from tinylm.model import GPT  # noqa: E402
from tinylm.model.lora import LoRALinear, LoraSettings, adapter_state, add_lora  # noqa: E402
from tinylm.run import checkpoint_path, load_run, write_run_info  # noqa: E402
from tinylm.tokenizers import train_bpe  # noqa: E402

MODES = {"base": ("plain", ["BASE"]), "base, stacked": ("stacked", ["BASE"]), "one adapter": ("stacked", ["a"]),
         "two adapters": ("stacked", ["a", "b"]), "base + two": ("stacked", ["BASE", "a", "b"])}


def make_random_run(folder: Path, texts: list[str], preset: str) -> Path:
    """A run folder with the preset's model, random weights, and a BPE tokenizer of 4096 tokens (as
    benchmarks/serve.py makes the tiny one)."""
    tok = train_bpe(texts, vocab_size=4096, pattern="gpt4", workers=1)
    model_config = dataclasses.replace(build_config(load_preset(preset)).model, vocab_size=tok.vocab_size)
    config = Config(model_config, TrainConfig())
    torch.manual_seed(0)
    save_checkpoint(checkpoint_path(folder, "best"), model_state=GPT(model_config).state_dict(), optimizer_state=None,
                    rng_state={}, state={"step": 0}, config=config, tokenizer=tok)
    (folder / "config.toml").write_text(dump_toml(config.to_dict()), encoding="utf-8")
    write_run_info(folder, {"status": "random weights, for benchmarks/serve_adapters.py"})
    return folder


def make_adapter(folder: Path, base_run: Path, seed: int, rank: int) -> Path:
    """A LoRA run adapting ``base_run``'s best checkpoint at ``rank`` on every matrix, its B drawn at random."""
    base = load_checkpoint(checkpoint_path(base_run, "best"))
    model = add_lora(base.build_model(), LoraSettings(rank, 2.0 * rank))
    draw = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LoRALinear):
                m.lora_B.copy_(torch.randn(m.lora_B.shape, generator=draw) * 0.02)
    config = Config(base.config.model, dataclasses.replace(base.config.train, lora_rank=rank, lora_alpha=2.0 * rank))
    where = checkpoint_path(folder, "best")
    save_checkpoint(where, model_state=adapter_state(model), optimizer_state=None, rng_state={},
                    state={"step": 1, LORA_BASE: lora_base_record(base, where)}, config=config,
                    tokenizer=base.tokenizer)
    (folder / "config.toml").write_text(dump_toml(config.to_dict()), encoding="utf-8")
    write_run_info(folder, {"status": "random adapter, for benchmarks/serve_adapters.py"})
    return folder


# ----- over HTTP: the real server ---------------------------------------------------------------------


async def http_round(url: str, models: list[str], prompts: list[str], clients: int, requests: int,
                     max_tokens: int) -> float:
    """``clients`` concurrent clients, each sending ``requests`` requests in turn (request i to ``models[i % m]``);
    generated tokens per second over the round."""
    tokens = 0

    async def client(c: int, http: httpx.AsyncClient) -> None:
        nonlocal tokens
        for r in range(requests):
            i = c * requests + r
            body = {"model": models[i % len(models)], "prompt": prompts[i % len(prompts)], "max_tokens": max_tokens,
                    "temperature": 1.0, "seed": i}
            response = await http.post(url + "/v1/completions", json=body)
            response.raise_for_status()
            tokens += response.json()["usage"]["completion_tokens"]

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=clients + 4)) as http:
        await asyncio.gather(*(client(c, http) for c in range(min(clients, 4))))  # warm up, not counted
        tokens = 0
        start = time.perf_counter()
        await asyncio.gather(*(client(c, http) for c in range(clients)))
        return tokens / (time.perf_counter() - start)


def http_servers(run_dir: Path, adapters: dict[str, Path], tmp: Path, threads: int) -> dict[str, Server]:
    """The two servers: the base alone ("plain") and the base with the adapters ("stacked")."""
    plain = Server(run_dir, tmp / "serve-plain.log", "--threads", str(threads))
    flags = [f for name, folder in adapters.items() for f in ("--adapter", f"{name}={folder}")]
    stacked = Server(run_dir, tmp / "serve-stacked.log", "--threads", str(threads), *flags)
    return {"plain": plain, "stacked": stacked}


# ----- in this process: the scheduler alone --------------------------------------------------------------


class DirectServer:
    """A `Scheduler` over the run's model (``adapters``: stacked on it), clients as threads."""

    def __init__(self, run_dir: Path, adapters: dict[str, Path], device: str) -> None:
        from tinylm.serve.adapters import ServedAdapters, find_adapters
        from tinylm.serve.scheduler import Scheduler

        self.run = load_run(run_dir, device=device)
        self.stacked = ServedAdapters(self.run.model, find_adapters(adapters)) if adapters else None
        self.scheduler = Scheduler(self.run.model, self.run.tokenizer, adapters=self.stacked).start()

    def request(self, model: str, prompt: str, seed: int, max_tokens: int) -> int:
        """One request, waited for; the tokens it generated."""
        from tinylm.serve.jobs import ChoiceEvent, Job, JobDone, JobFailed

        done, count, failure = threading.Event(), [0], []

        def on_event(events: list) -> None:
            for event in events:
                if isinstance(event, ChoiceEvent):
                    count[0] += event.generated
                elif isinstance(event, JobFailed):
                    failure.append(event.message)
                if isinstance(event, (JobDone, JobFailed)):
                    done.set()

        ids = self.run.start_ids + self.run.tokenizer.encode(prompt)
        adapter = 0 if model == "BASE" else self.stacked.index(model)
        self.scheduler.submit(Job([ids], SamplingParams(max_new_tokens=max_tokens, temperature=1.0, seed=seed),
                                  on_event=on_event, adapter=adapter))
        done.wait()
        if failure:
            raise RuntimeError(failure[0])
        return count[0]

    def close(self) -> None:
        self.scheduler.close()


def direct_round(server: DirectServer, models: list[str], prompts: list[str], clients: int, requests: int,
                 max_tokens: int) -> float:
    """As `http_round`, with threads calling the scheduler."""
    tokens = [0] * clients

    def client(c: int) -> None:
        for r in range(requests):
            i = c * requests + r
            tokens[c] += server.request(models[i % len(models)], prompts[i % len(prompts)], i, max_tokens)

    def run_clients(n: int) -> None:
        threads = [threading.Thread(target=client, args=(c,)) for c in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    run_clients(min(clients, 4))  # warm up, not counted
    tokens[:] = [0] * clients
    start = time.perf_counter()
    run_clients(clients)
    return sum(tokens) / (time.perf_counter() - start)


# ----- the rounds and the table ----------------------------------------------------------------------------


def measure(args: argparse.Namespace, run_dir: Path, adapters: dict[str, Path], prompts: list[str],
            tmp: Path) -> dict[tuple[str, int], list[float]]:
    """tokens/s per (mode, clients): every repeat's."""
    if args.direct:
        servers = {"plain": DirectServer(run_dir, {}, args.device), "stacked": DirectServer(run_dir, adapters,
                                                                                             args.device)}
    else:
        servers = http_servers(run_dir, adapters, tmp, args.threads)
    rates: dict[tuple[str, int], list[float]] = {(mode, c): [] for mode in MODES for c in CLIENTS[1:]}
    try:
        base = run_dir.name
        for repeat in range(args.repeats):
            for clients in CLIENTS[1:]:
                for mode, (kind, models) in list(MODES.items())[::1 if repeat % 2 == 0 else -1]:
                    server = servers[kind]
                    if args.direct:
                        rate = direct_round(server, models, prompts, clients, args.requests, args.max_tokens)
                    else:
                        named = [base if m == "BASE" else m for m in models]
                        rate = asyncio.run(http_round(server.url, named, prompts, clients, args.requests,
                                                      args.max_tokens))
                    rates[mode, clients].append(rate)
    finally:
        for server in servers.values():
            server.close()
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--run", help="a trained run to serve (default: the tiny preset with random weights)")
    parser.add_argument("--preset", default="tiny", help="without --run: the preset of random weights (default: tiny)")
    parser.add_argument("--rank", type=int, default=8, help="the adapters' rank (default: 8)")
    parser.add_argument("--requests", type=int, default=4, help="requests per client (default: 4)")
    parser.add_argument("--max-tokens", type=int, default=32, help="new tokens per request (default: 32)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds per row, taken in turns (default: 3)")
    parser.add_argument("--threads", type=int, default=1, help="the server's PyTorch threads (default: 1)")
    parser.add_argument("--direct", action="store_true", help="drive the scheduler in this process, no HTTP")
    parser.add_argument("--device", default="cpu", help="with --direct: where the model runs (default: cpu)")
    args = parser.parse_args()
    if args.direct:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        texts = corpus_texts()
        run_dir = Path(args.run) if args.run else make_random_run(tmp / f"{args.preset}-random", texts, args.preset)
        adapters = {name: make_adapter(tmp / f"lora-{name}", run_dir, seed, args.rank)
                    for seed, name in enumerate(("a", "b"), start=1)}
        how = f"--direct on {args.device}" if args.direct else "tinylm serve over HTTP"
        print(f"serving {run_dir} with 2 adapters of rank {args.rank} ({how}) | {args.requests} requests per "
              f"client, {args.max_tokens} new tokens each, median of {args.repeats} rounds | {args.threads} "
              f"thread(s), {os.cpu_count()} cores")
        rates = measure(args, run_dir, adapters, prompts_from(texts), tmp)
    header = f"{'mode':<15} {'clients':>7} {'tokens/s':>9} {'vs base':>8}"
    print(header)
    print("-" * len(header))
    median = {key: statistics.median(values) for key, values in rates.items()}
    for mode in MODES:
        for clients in CLIENTS[1:]:
            print(f"{mode:<15} {clients:>7} {median[mode, clients]:>9.1f} "
                  f"{median[mode, clients] / median['base', clients]:>7.2f}x")
    for mode in ("base, stacked", "two adapters"):
        ratios = ", ".join(f"{c} clients {median[mode, c] / median['base', c]:.2f}x" for c in CLIENTS[1:])
        print(f"{mode} / base: {ratios}")


if __name__ == "__main__":
    main()
