"""Many clients at once: complete and correct streams, batched; a client that leaves frees its slot."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
from servekit import SlowLM, ThreadServer

from tinylm.generate import SamplingParams, generate

WORDS = "to be or not that is the question whether tis nobler in mind suffer slings arrows café 東京 🙂".split()


def test_32_concurrent_streaming_clients_get_complete_correct_streams(server, run, run_dir):
    """32 clients with their own prompts, settings and seeds, arriving staggered so rows join a running batch.

    Each stream must end with a finish reason and be exactly the library's completion for that client.
    """
    requests = []
    for i in range(32):
        prompt = " ".join(WORDS[(i * 3 + j) % len(WORDS)] for j in range(1 + i % 7))
        settings = dict(max_tokens=10 + (i * 7) % 30, temperature=[0.0, 0.7, 1.0, 1.4][i % 4], seed=100 + i,
                        stop=["e "] if i % 5 == 0 else None, top_k=[None, 20][i % 2])
        requests.append((prompt, settings))
    before = httpx.get(server.base_url + "/health").json()["scheduler"]

    async def one(client: openai.AsyncOpenAI, i: int, prompt: str, settings: dict):
        await asyncio.sleep(0.01 * (i % 8))  # arrivals spread over ~70 ms: some join a batch already running
        extra = {"top_k": settings["top_k"]} if settings["top_k"] else {}
        text, finish, chunks = "", None, 0
        stream = await client.completions.create(
            model=run_dir.name, prompt=prompt, max_tokens=settings["max_tokens"], temperature=settings["temperature"],
            seed=settings["seed"], stop=settings["stop"], stream=True, extra_body=extra)
        async for chunk in stream:
            chunks += 1
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        return text, finish, chunks

    async def all_clients():
        async with openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="-", max_retries=0, timeout=120) as c:
            return await asyncio.gather(*(one(c, i, p, s) for i, (p, s) in enumerate(requests)))

    results = asyncio.run(all_clients())
    for (prompt, settings), (text, finish, chunks) in zip(requests, results):
        [expected] = generate(run.model, run.tokenizer, prompt, SamplingParams(
            max_new_tokens=settings["max_tokens"], temperature=settings["temperature"], seed=settings["seed"],
            stop=settings["stop"] or (), top_k=settings["top_k"]), start_ids=run.start_ids)
        assert (text, finish) == (expected.text, expected.finish_reason), prompt
        assert chunks >= 1
    after = httpx.get(server.base_url + "/health").json()["scheduler"]
    assert after["jobs"] - before["jobs"] == 32
    assert after["largest_batch"] >= 8  # the requests were decoded together, not one by one
    assert after["active_rows"] == 0 and after["waiting_rows"] == 0


def wait_for(condition, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return False


def test_a_client_that_disconnects_frees_its_slot(run):
    """A slow model (20 ms a step): 60 tokens take over a second, so leaving after two chunks surely cancels."""
    slow = type("SlowRun", (), {"model": SlowLM(run.model, 0.02), "tokenizer": run.tokenizer,
                                "start_ids": run.start_ids, "path": run.path})
    with ThreadServer(slow, max_batch_size=1) as served:
        body = {"prompt": "To be", "max_tokens": 60, "stream": True, "temperature": 0}
        with httpx.stream("POST", served.base_url + "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            while next(lines) != "" or served.scheduler.stats()["steps"] < 2:
                pass  # read until two decoding steps have happened, then hang up mid-stream
        assert wait_for(lambda: served.scheduler.stats()["active_rows"] == 0, timeout=1.0)
        assert served.scheduler.stats()["cancelled_rows"] == 1  # it was cancelled, not finished

        # the same for a client waiting on a whole (non-streamed) response
        try:
            httpx.post(served.base_url + "/v1/completions", json={**body, "stream": False}, timeout=0.3)
        except httpx.ReadTimeout:
            pass
        assert wait_for(lambda: served.scheduler.stats()["cancelled_rows"] == 2, timeout=1.0)
        assert served.scheduler.stats()["active_rows"] == 0

        # the server is not wedged: the only slot is free and serves the next client in full
        out = httpx.post(served.base_url + "/v1/completions", json={**body, "stream": False, "max_tokens": 5}).json()
        assert out["usage"]["completion_tokens"] == 5 and out["choices"][0]["finish_reason"] == "length"
