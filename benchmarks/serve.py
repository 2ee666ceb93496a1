"""Benchmark: `tinylm serve` under 1, 8 and 32 concurrent clients, with batching and one request at a time.

Run from the repository root::

    python benchmarks/serve.py                          # the tiny preset, random weights
    python benchmarks/serve.py --run runs/tiny-shakespeare --requests 8 --max-tokens 64

What is measured: the real server (`tinylm serve`, in its own process) runs twice on the same
run, once with ``--max-batch-size 32`` (requests in flight decoded together) and once with
``--max-batch-size 1`` (one request at a time, queued in arrival order). Against each, C = 1, 8
and 32 clients each send ``--requests`` completion requests one after another (a prompt of a
dozen tokens from the corpus, ``--max-tokens`` new tokens, temperature 1 with a per-request
seed; a random model almost never stops early, so every request does the same work). Both
servers stay up (an idle one sleeps) and the rounds are taken in turns, the two modes one after
the other for each C (in alternating order), ``--repeats`` times, so that a change in machine
load hits both alike.
Reported per row: requests/s and generated tokens/s over the wall time of a round (the median
of the repeats), and the 50th and 99th percentile of the request latency (sent to whole
response received; all repeats pooled). The last line gives batching's throughput gain:
requests/s batched over requests/s one at a time.

The model is the tiny preset (4 layers, d = 192, 6 heads, RoPE, RMSNorm, SwiGLU) with random
weights and a byte-level BPE tokenizer of |V| = 4096 trained on a megabyte of the standard
library's source (always on disk), unless ``--run`` names a trained run. The server runs PyTorch
on ``--threads`` threads (default 1, leaving the other cores to the clients and the HTTP
stack). Each round starts with a few warm-up requests that are not counted.

This is a measurement, not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

from tinylm.config import Config, TrainConfig, build_config, dump_toml, load_preset
from tinylm.data.corpora import load_corpus
from tinylm.model import GPT
from tinylm.run import checkpoint_path, save_checkpoint, write_run_info
from tinylm.tokenizers import train_bpe

CLIENTS = (1, 8, 32)


# ----- the run and its prompts ----------------------------------------------------------------------


def corpus_texts(megabytes: float = 1.0) -> list[str]:
    texts, size = [], 0
    for text in load_corpus("stdlib").texts():
        texts.append(text)
        size += len(text)
        if size > megabytes * 1e6:
            break
    return texts


def make_tiny_run(folder: Path, texts: list[str]) -> Path:
    """A run folder with the tiny preset's model, random weights, and a BPE tokenizer of 4096 tokens."""
    tok = train_bpe(texts, vocab_size=4096, pattern="gpt4", workers=1)
    preset = build_config(load_preset("tiny"))
    model_config = preset.model.__class__(**{**preset.model.__dict__, "vocab_size": tok.vocab_size})
    config = Config(model_config, TrainConfig())
    torch.manual_seed(0)
    model = GPT(model_config)
    save_checkpoint(checkpoint_path(folder, "best"), model_state=model.state_dict(), optimizer_state=None,
                    rng_state={}, state={"step": 0}, config=config, tokenizer=tok)
    (folder / "config.toml").write_text(dump_toml(config.to_dict()), encoding="utf-8")
    write_run_info(folder, {"status": "random weights, for benchmarks/serve.py"})
    return folder


def prompts_from(texts: list[str], n: int = 64, chars: int = 48) -> list[str]:
    """``n`` prompts of about a dozen tokens: line starts from the corpus."""
    lines = [line.strip() for text in texts for line in text.splitlines() if len(line.strip()) > chars]
    step = max(1, len(lines) // n)
    return [line[:chars] for line in lines[::step][:n]]


# ----- the server ------------------------------------------------------------------------------------


class Server:
    """`tinylm serve` in a subprocess on a free port."""

    def __init__(self, run_dir: Path, log: Path, *flags: str) -> None:
        self.log = log
        with open(log, "w") as out:
            self.process = subprocess.Popen([sys.executable, "-m", "tinylm", "serve", "--run", str(run_dir),
                                             "--port", "0", "--log-level", "warning", *flags],
                                            stdout=out, stderr=subprocess.STDOUT,
                                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            found = re.search(r"at (http://\S+:\d+) ", log.read_text())
            if found:
                self.url = found.group(1)
                return
            if self.process.poll() is not None:
                raise RuntimeError(f"tinylm serve exited: {log.read_text()}")
            time.sleep(0.1)
        raise TimeoutError("tinylm serve did not start")

    def close(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)


# ----- the clients -----------------------------------------------------------------------------------


async def round_of(url: str, model: str, prompts: list[str], clients: int, requests: int, max_tokens: int) -> dict:
    """``clients`` concurrent clients, each sending ``requests`` requests in turn; the round's numbers."""
    latencies: list[float] = []
    tokens = 0

    async def client(c: int, http: httpx.AsyncClient) -> None:
        nonlocal tokens
        for r in range(requests):
            i = c * requests + r
            body = {"model": model, "prompt": prompts[i % len(prompts)], "max_tokens": max_tokens,
                    "temperature": 1.0, "seed": i}
            start = time.perf_counter()
            response = await http.post(url + "/v1/completions", json=body)
            latencies.append(time.perf_counter() - start)
            response.raise_for_status()
            tokens += response.json()["usage"]["completion_tokens"]

    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        await asyncio.gather(*(client(c, http) for c in range(min(clients, 4))))  # warm up, not counted
        latencies.clear()
        tokens = 0
        start = time.perf_counter()
        await asyncio.gather(*(client(c, http) for c in range(clients)))
        wall = time.perf_counter() - start
    return {"requests": len(latencies), "req/s": len(latencies) / wall, "tokens/s": tokens / wall,
            "latencies": latencies}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--run", help="a trained run to serve (default: the tiny preset with random weights)")
    parser.add_argument("--requests", type=int, default=4, help="requests per client (default: 4)")
    parser.add_argument("--max-tokens", type=int, default=32, help="new tokens per request (default: 32)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds per row, taken in turns (default: 3)")
    parser.add_argument("--threads", type=int, default=1, help="the server's PyTorch threads (default: 1)")
    args = parser.parse_args()

    texts = corpus_texts()
    prompts = prompts_from(texts)
    modes = {"batched": 32, "one at a time": 1}
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(args.run) if args.run else make_tiny_run(Path(tmp) / "tiny-random", texts)
        print(f"serving {run_dir} | {args.requests} requests per client, {args.max_tokens} new tokens each, "
              f"median of {args.repeats} rounds | server on {args.threads} thread(s), {os.cpu_count()} cores")
        servers = {mode: Server(run_dir, Path(tmp) / f"serve-{batch}.log", "--max-batch-size", str(batch),
                                "--threads", str(args.threads)) for mode, batch in modes.items()}
        rounds: dict[tuple[str, int], list[dict]] = {(mode, c): [] for mode in modes for c in CLIENTS}
        try:
            model = httpx.get(servers["batched"].url + "/v1/models").json()["data"][0]["id"]
            for repeat in range(args.repeats):
                for clients in CLIENTS:
                    # which mode goes first alternates, so neither always follows the other's busiest round
                    for mode, server in list(servers.items())[::1 if repeat % 2 == 0 else -1]:
                        rounds[mode, clients].append(asyncio.run(
                            round_of(server.url, model, prompts, clients, args.requests, args.max_tokens)))
        finally:
            for server in servers.values():
                server.close()

    header = f"{'mode':<14} {'clients':>7} {'requests':>8} {'req/s':>8} {'tokens/s':>9} {'p50 ms':>8} {'p99 ms':>8}"
    print(header)
    print("-" * len(header))
    rate = {}
    for mode in modes:
        for clients in CLIENTS:
            rs = rounds[mode, clients]
            rate[mode, clients] = statistics.median(r["req/s"] for r in rs)
            latencies = sorted(x for r in rs for x in r["latencies"])
            p99 = latencies[min(len(latencies) - 1, round(0.99 * (len(latencies) - 1)))]
            print(f"{mode:<14} {clients:>7} {rs[0]['requests']:>8} {rate[mode, clients]:>8.2f} "
                  f"{statistics.median(r['tokens/s'] for r in rs):>9.1f} {statistics.median(latencies) * 1000:>8.0f} "
                  f"{p99 * 1000:>8.0f}")
    gains = ", ".join(f"{c} client{'s' if c > 1 else ''}: {rate['batched', c] / rate['one at a time', c]:.2f}x"
                      for c in CLIENTS)
    print(f"\nthroughput gain of batching (req/s batched / one at a time): {gains}")


if __name__ == "__main__":
    main()
