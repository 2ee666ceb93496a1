"""Many clients at once: complete and correct streams, batched; a client that leaves frees its slot."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import threading
import time

import httpx
import openai
import pytest
from servekit import SlowLM, ThreadServer, wait_for

import tinylm.serve.scheduler as scheduler_module
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


def test_a_client_that_disconnects_frees_its_slot(run):
    """A slow model (50 ms a step): 60 tokens take 3 s, so leaving after two chunks surely cancels, with time to
    spare for noticing the disconnect on a loaded machine."""
    with ThreadServer(slow_run(run, 0.05), max_batch_size=1) as served:
        body = {"prompt": "To be", "max_tokens": 60, "stream": True, "temperature": 0}
        with httpx.stream("POST", served.base_url + "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            while next(lines) != "" or served.scheduler.stats()["steps"] < 2:
                pass  # read until two decoding steps have happened, then hang up mid-stream
        assert wait_for(lambda: served.scheduler.stats()["active_rows"] == 0, timeout=2.5)
        assert served.scheduler.stats()["cancelled_rows"] == 1  # it was cancelled, not finished

        # the same for a client waiting on a whole (non-streamed) response
        try:
            httpx.post(served.base_url + "/v1/completions", json={**body, "stream": False}, timeout=0.3)
        except httpx.ReadTimeout:
            pass
        assert wait_for(lambda: served.scheduler.stats()["cancelled_rows"] == 2, timeout=2.5)
        assert served.scheduler.stats()["active_rows"] == 0

        # the server is not wedged: the only slot is free and serves the next client in full
        out = httpx.post(served.base_url + "/v1/completions", json={**body, "stream": False, "max_tokens": 5}).json()
        assert out["usage"]["completion_tokens"] == 5 and out["choices"][0]["finish_reason"] == "length"


def slow_run(run, delay: float):
    return type("SlowRun", (), {"model": SlowLM(run.model, delay), "tokenizer": run.tokenizer,
                                "start_ids": run.start_ids, "path": run.path})


class ErrorLog(logging.Handler):
    """The records uvicorn logs at ERROR (an exception escaping the app: "Exception in ASGI application")."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_a_non_streaming_client_that_leaves_leaves_no_error_behind(run):
    with ThreadServer(slow_run(run, 0.05), max_batch_size=1) as served:
        errors = ErrorLog()
        logging.getLogger("uvicorn.error").addHandler(errors)  # after the server set up uvicorn's logging
        try:
            body = {"prompt": "To be", "max_tokens": 60, "temperature": 0}
            try:
                httpx.post(served.base_url + "/v1/completions", json=body, timeout=0.2)
            except httpx.ReadTimeout:
                pass
            assert wait_for(lambda: served.scheduler.stats()["cancelled_rows"] == 1, timeout=2.0)
            out = httpx.post(served.base_url + "/v1/completions", json={**body, "max_tokens": 2}).json()
            assert out["choices"][0]["finish_reason"] == "length"  # the next request is served
        finally:
            logging.getLogger("uvicorn.error").removeHandler(errors)
        assert not errors.records, [r.getMessage() for r in errors.records]


def test_a_request_that_fails_in_sampling_fails_alone(run, monkeypatch):
    """While two ordinary requests run (one streamed), requests with extreme settings arrive: the ones the
    sampling functions cannot handle are refused with 400, and one that fails while sampling (forced here) gets
    its own error; the ordinary two finish with the library's completions."""
    real_sample = scheduler_module.sample

    def breaks_on_top_p_half(logits, params, generators=None):
        if params.top_p == 0.5:
            raise IndexError("index -1 is out of bounds for dimension 1 with size 0")
        return real_sample(logits, params, generators)

    monkeypatch.setattr(scheduler_module, "sample", breaks_on_top_p_half)
    with ThreadServer(slow_run(run, 0.01)) as served:
        api = openai.OpenAI(base_url=served.base_url + "/v1", api_key="-", max_retries=0, timeout=30)
        model = api.models.list().data[0].id
        results = {}

        def whole():
            out = api.completions.create(model=model, prompt="To be", max_tokens=30, temperature=0)
            results["whole"] = (out.choices[0].text, out.choices[0].finish_reason)

        def streamed():
            text, finish = "", None
            for chunk in api.completions.create(model=model, prompt="東京", max_tokens=30, seed=5, stream=True):
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
            results["streamed"] = (text, finish)

        threads = [threading.Thread(target=whole), threading.Thread(target=streamed)]
        for t in threads:
            t.start()
        assert wait_for(lambda: served.scheduler.stats()["active_rows"] == 2)
        for extreme in ({"top_p": 1e-6}, {"temperature": 1e-38}):
            with pytest.raises(openai.BadRequestError):
                api.completions.create(model=model, prompt="x", max_tokens=2, **extreme)
        with pytest.raises(openai.InternalServerError) as failed:
            api.completions.create(model=model, prompt="x", max_tokens=2, top_p=0.5)
        assert "IndexError" in failed.value.message
        stream = api.completions.create(model=model, prompt="x", max_tokens=2, top_p=0.5, stream=True)
        with pytest.raises(openai.APIError, match="IndexError"):  # a stream carries the error in a chunk
            list(stream)
        assert served.scheduler.stats()["active_rows"] == 2  # the ordinary two are still running
        for t in threads:
            t.join(30)
    for key, prompt, settings in (("whole", "To be", dict(temperature=0)), ("streamed", "東京", dict(seed=5))):
        [expected] = generate(run.model, run.tokenizer, prompt, SamplingParams(max_new_tokens=30, **settings),
                              start_ids=run.start_ids)
        assert results[key] == (expected.text, expected.finish_reason), key


def stop_during_two_requests(run, graceful_timeout: float, stop) -> tuple[dict, float, list]:
    """Two requests on a slow model (50 ms a step: 55 tokens take 3 s), one whole and one streamed; once both run,
    ``stop(served)`` stops the server. Returns their results, the seconds from the stop until both ended, and what
    uvicorn logged at ERROR meanwhile."""
    served = ThreadServer(slow_run(run, 0.05), graceful_timeout=graceful_timeout)
    errors = ErrorLog()
    logging.getLogger("uvicorn.error").addHandler(errors)
    body = {"prompt": "To be", "max_tokens": 55, "temperature": 0}
    results = {}

    def whole():
        results["whole"] = httpx.post(served.base_url + "/v1/completions", json=body, timeout=30)

    def streamed():
        with httpx.stream("POST", served.base_url + "/v1/completions", json={**body, "stream": True},
                          timeout=30) as response:
            results["streamed"] = [line for line in response.iter_lines() if line]

    threads = [threading.Thread(target=whole), threading.Thread(target=streamed)]
    try:
        for t in threads:
            t.start()
        assert wait_for(lambda: served.scheduler.stats()["active_rows"] == 2)
        started = time.monotonic()
        stop(served)
        for t in threads:
            t.join(10)
        served.thread.join(10)
        assert not served.thread.is_alive()
        return results, time.monotonic() - started, errors.records
    finally:
        logging.getLogger("uvicorn.error").removeHandler(errors)


def assert_answered_with_503(results: dict) -> None:
    """The whole response is a 503 in OpenAI's error JSON; the stream has text chunks, that error, then [DONE]."""
    answer = results["whole"]
    assert answer.status_code == 503 and answer.json()["error"]["message"] == "the server is shutting down"
    lines = results["streamed"]
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2].removeprefix("data: "))["error"]["message"] == "the server is shutting down"
    assert all(json.loads(line[6:])["choices"] for line in lines[:-2])  # text chunks before it


def test_a_shutdown_answers_the_requests_still_running_and_logs_no_error(run):
    """Requests still running when the server stops (Ctrl+C, SIGTERM) past the graceful timeout: the one waiting
    for a whole response gets a 503 in OpenAI's error JSON, the stream gets the error as a chunk and [DONE];
    uvicorn cancels nothing, so nothing is logged at ERROR (a traceback, "Cancel 2 running task(s)")."""
    # what Ctrl+C does: should_exit; the server waits for the requests, then ends them before the timeout
    results, seconds, errors = stop_during_two_requests(run, 0.4, lambda served: served.close())
    assert seconds < 2.0
    assert_answered_with_503(results)
    assert not errors, [r.getMessage() for r in errors]


def test_a_second_ctrl_c_ends_the_requests_at_once_and_still_answers_them(run):
    """Uvicorn reads a second Ctrl+C as "force quit" and would cancel the requests in flight (a plain-text 500, cut
    streams, tracebacks). tinylm ends their generations at once instead: 503 JSON and an error chunk, no waiting
    out the graceful timeout (30 s here), nothing logged at ERROR."""
    def ctrl_c_twice(served):
        served.server.handle_exit(signal.SIGINT, None)  # Ctrl+C: stop taking connections, wait for these
        steps = served.scheduler.stats()["steps"]  # still generating a few steps later: the first one waits
        assert wait_for(lambda: served.scheduler.stats()["steps"] >= steps + 3)
        assert served.scheduler.stats()["active_rows"] == 2
        served.server.handle_exit(signal.SIGINT, None)  # Ctrl+C again

    results, seconds, errors = stop_during_two_requests(run, 30, ctrl_c_twice)
    assert seconds < 2.5
    assert_answered_with_503(results)
    assert not errors, [r.getMessage() for r in errors]
