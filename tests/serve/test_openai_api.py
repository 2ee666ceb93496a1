"""The API through the official `openai` client, against the real `tinylm serve` command.

The oracles: the `openai` client itself (it must parse every response into its types), and the
library on the same run (`tinylm.generate.generate`, a forward pass of the model): the server's
greedy and seeded completions must be the library's, token for token.
"""

from __future__ import annotations

import dataclasses

import asyncio
import base64
import json
import math
import warnings
from types import SimpleNamespace

import httpx
import numpy as np
import openai
import pytest
import torch
from servekit import ThreadServer, counted_ngram

from tinylm.generate import SamplingParams, generate
from tinylm.generate.inspect import next_token_candidates, next_token_logits
from tinylm.serve.chat import STOP, chat_prompt, reply_text
from tinylm.tokenizers.base import generation_excluded

PROMPTS = ["To be, or not", "Naïve café", "東京", "", "the slings and arrows of outrageous fortune"]


def library(run, prompt, **settings):
    """The library's completions of ``prompt`` on the same run (start ids first, as the server does)."""
    return generate(run.model, run.tokenizer, prompt, SamplingParams(**settings), start_ids=run.start_ids)


def test_models_list_and_retrieve(client, run_dir):
    models = client.models.list().data
    assert [m.id for m in models] == [run_dir.name]
    assert client.models.retrieve(run_dir.name).id == run_dir.name
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def test_a_trailing_slash_lists_the_models_and_head_probes_health(server, run_dir):
    listed = httpx.get(server.base_url + "/v1/models/", follow_redirects=True)
    assert listed.status_code == 200 and [m["id"] for m in listed.json()["data"]] == [run_dir.name]
    probe = httpx.head(server.base_url + "/health")
    assert probe.status_code == 200 and probe.content == b""


def test_the_api_schema_gives_each_operation_its_own_id_without_a_warning(run):
    """GET and HEAD of a path as one route gave both operations one id, and FastAPI warned "Duplicate Operation
    ID" while building /openapi.json. HEAD is GET without the body: the schema lists GET alone (HEAD still
    answers, as the tests of HEAD requests check)."""
    from tinylm.serve.app import create_app

    app = create_app(run)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        schema = app.openapi()
    ids = [operation["operationId"] for operations in schema["paths"].values() for operation in operations.values()]
    assert len(ids) == len(set(ids)), ids
    for path in ("/health", "/v1/models", "/v1/models/{model_id}"):
        assert set(schema["paths"][path]) == {"get"}, path


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_completion_is_the_library_s(client, run, run_dir, prompt):
    out = client.completions.create(model=run_dir.name, prompt=prompt, max_tokens=24, temperature=0)
    [expected] = library(run, prompt, max_new_tokens=24, temperature=0)
    choice = out.choices[0]
    assert (choice.text, choice.finish_reason) == (expected.text, expected.finish_reason)
    n_prompt = len(run.start_ids) + len(run.tokenizer.encode(prompt))
    assert out.usage.prompt_tokens == n_prompt
    assert out.usage.completion_tokens == len(expected.token_ids)
    assert out.usage.total_tokens == n_prompt + len(expected.token_ids)
    assert out.object == "text_completion" and out.id.startswith("cmpl-")


def test_seeded_samples_for_a_list_of_prompts_are_the_library_s(client, run, run_dir):
    settings = dict(temperature=0.9, top_p=0.95, seed=7, n=3, max_tokens=16,
                    extra_body={"top_k": 40, "min_p": 0.01})
    out = client.completions.create(model=run_dir.name, prompt=PROMPTS[:2], **settings)
    expected = generate(run.model, run.tokenizer, PROMPTS[:2],
                        SamplingParams(temperature=0.9, top_p=0.95, top_k=40, min_p=0.01, seed=7, num_samples=3,
                                       max_new_tokens=16), start_ids=run.start_ids)
    assert [c.index for c in out.choices] == list(range(6))  # prompt i's sample j at i * n + j
    assert [c.text for c in out.choices] == [c.text for c in expected]
    assert len({c.text for c in out.choices}) > 1  # the samples differ from each other
    again = client.completions.create(model=run_dir.name, prompt=PROMPTS[:2], **settings)
    assert [c.text for c in again.choices] == [c.text for c in out.choices]
    other = client.completions.create(model=run_dir.name, prompt=PROMPTS[:2], **{**settings, "seed": 8})
    assert [c.text for c in other.choices] != [c.text for c in out.choices]


def test_token_id_prompts_are_the_same_as_their_text(client, run, run_dir):
    ids = run.tokenizer.encode(PROMPTS[0])
    by_text = client.completions.create(model=run_dir.name, prompt=PROMPTS[0], max_tokens=10, temperature=0)
    by_ids = client.completions.create(model=run_dir.name, prompt=ids, max_tokens=10, temperature=0)
    by_lists = client.completions.create(model=run_dir.name, prompt=[ids, ids], max_tokens=10, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert [c.text for c in by_lists.choices] == [by_text.choices[0].text] * 2


def test_stop_strings_cut_the_text_as_the_library_does(client, run, run_dir):
    [free] = library(run, PROMPTS[0], max_new_tokens=40, temperature=0)
    stop = next(free.text[i:i + 2] for i in range(4, len(free.text)) if "\ufffd" not in free.text[i:i + 2])
    out = client.completions.create(model=run_dir.name, prompt=PROMPTS[0], max_tokens=40, temperature=0, stop=[stop])
    [expected] = library(run, PROMPTS[0], max_new_tokens=40, temperature=0, stop=[stop])
    assert out.choices[0].text == expected.text == free.text[:free.text.index(stop)]
    assert out.choices[0].finish_reason == "stop"


def test_streamed_completion_concatenates_to_the_whole_one(client, run_dir):
    settings = dict(model=run_dir.name, prompt=PROMPTS[:2], n=2, max_tokens=30, temperature=1.0, seed=5)
    whole = client.completions.create(**settings)
    pieces: dict[int, str] = {}
    finish: dict[int, str] = {}
    usage = None
    for chunk in client.completions.create(**settings, stream=True, stream_options={"include_usage": True}):
        for c in chunk.choices:
            pieces[c.index] = pieces.get(c.index, "") + c.text
            if c.finish_reason:
                finish[c.index] = c.finish_reason
        usage = chunk.usage or usage
    assert [pieces[i] for i in range(4)] == [c.text for c in whole.choices]
    assert [finish[i] for i in range(4)] == [c.finish_reason for c in whole.choices]
    assert usage == whole.usage


def test_streamed_logprobs_and_echo_concatenate_to_the_whole_ones(client, run_dir):
    settings = dict(model=run_dir.name, prompt=["To be", "Naïve"], n=2, max_tokens=20, seed=2, echo=True, logprobs=2)
    whole = client.completions.create(**settings)
    joined = {i: {"text": "", "tokens": [], "token_logprobs": [], "text_offset": []} for i in range(4)}
    for chunk in client.completions.create(**settings, stream=True):
        for c in chunk.choices:
            joined[c.index]["text"] += c.text
            for key in ("tokens", "token_logprobs", "text_offset"):
                joined[c.index][key] += getattr(c.logprobs, key)
    for i, choice in enumerate(whole.choices):
        assert choice.text.startswith(settings["prompt"][i // 2])
        assert joined[i] == {"text": choice.text, "tokens": choice.logprobs.tokens,
                             "token_logprobs": choice.logprobs.token_logprobs,
                             "text_offset": choice.logprobs.text_offset}


def test_the_event_stream_is_json_chunks_then_done(server, run_dir):
    body = {"model": run_dir.name, "prompt": "To be", "max_tokens": 12, "stream": True, "seed": 1}
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=30) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode("utf-8")
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


def test_logprobs_in_the_legacy_format(client, run, run_dir):
    out = client.completions.create(model=run_dir.name, prompt=PROMPTS[0], max_tokens=12, temperature=0, logprobs=3)
    [expected] = library(run, PROMPTS[0], max_new_tokens=12, temperature=0)
    lp = out.choices[0].logprobs
    shown = [t for t in expected.token_ids if t != run.tokenizer.eos_id]
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == len(shown)
    assert lp.token_logprobs == pytest.approx(expected.logprobs[:len(shown)], abs=1e-4)
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 3 <= len(top) <= 4 and top[token] == logprob  # the 3 best and the chosen one
        assert max(top.values()) == logprob  # greedy: the chosen token is the most likely
        assert math.fsum(math.exp(v) for v in top.values()) <= 1 + 1e-6
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_echo_returns_the_prompt_with_its_logprobs(client, run, run_dir):
    prompt = "To be, or not to be"
    out = client.completions.create(model=run_dir.name, prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    choice = out.choices[0]
    assert choice.text == prompt and out.usage.completion_tokens == 0
    ids = run.tokenizer.encode(prompt)
    assert choice.logprobs.tokens == [run.tokenizer.token_bytes(i).decode() for i in ids]
    # known answer: each token starts where the text of the tokens before it ends
    assert choice.logprobs.text_offset == [sum(map(len, choice.logprobs.tokens[:i])) for i in range(len(ids))]
    # oracle: log softmax of one forward pass over the start ids and the prompt
    seq = run.start_ids + ids
    with torch.no_grad():
        logits, _ = run.model(torch.tensor([seq]))  # (1, T, V)
    logp = torch.log_softmax(logits[0].float(), dim=-1)
    expected = [float(logp[t - 1, seq[t]]) for t in range(len(run.start_ids), len(seq))]
    assert choice.logprobs.token_logprobs == pytest.approx(expected, abs=1e-4)
    more = client.completions.create(model=run_dir.name, prompt=prompt, max_tokens=8, echo=True, temperature=0)
    plain = client.completions.create(model=run_dir.name, prompt=prompt, max_tokens=8, temperature=0)
    assert more.choices[0].text == prompt + plain.choices[0].text


def test_chat_completion_is_the_documented_template(client, run, run_dir, server):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a token?"}]
    out = client.chat.completions.create(model=run_dir.name, messages=messages, max_tokens=15, temperature=0)
    prompt = chat_prompt(messages)
    assert prompt == "System: Be brief.\nUser: What is a token?\nAssistant:"
    [expected] = library(run, prompt, max_new_tokens=15, temperature=0, stop=STOP)
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == reply_text(expected.text)
    assert out.choices[0].finish_reason == expected.finish_reason
    tokenized = httpx.post(server.base_url + "/tokenize", json={"messages": messages}).json()
    assert out.usage.prompt_tokens == tokenized["count"] == len(run.start_ids) + len(run.tokenizer.encode(prompt))
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")


def test_streamed_chat_concatenates_to_the_whole_one(client, run_dir):
    settings = dict(model=run_dir.name, messages=[{"role": "user", "content": "Hi"}], max_tokens=25, seed=11, n=2,
                    logprobs=True, top_logprobs=2)
    whole = client.chat.completions.create(**settings)
    content = {0: "", 1: ""}
    roles, tokens = set(), {0: 0, 1: 0}
    for chunk in client.chat.completions.create(**settings, stream=True):
        for c in chunk.choices:
            roles.add(c.delta.role)
            content[c.index] += c.delta.content or ""
            tokens[c.index] += len(c.logprobs.content) if c.logprobs else 0
    assert [content[0], content[1]] == [c.message.content for c in whole.choices]
    assert [tokens[0], tokens[1]] == [len(c.logprobs.content) for c in whole.choices]
    assert "assistant" in roles
    entry = whole.choices[0].logprobs.content[0]
    assert len(entry.top_logprobs) == 2 and bytes(entry.bytes).decode("utf-8", "replace")


def test_tokenize_and_detokenize(server, run):
    text = "Naïve café 🙂"
    out = httpx.post(server.base_url + "/tokenize", json={"prompt": text}).json()
    assert out["tokens"] == run.start_ids + run.tokenizer.encode(text) and out["max_model_len"] == 64
    bare = httpx.post(server.base_url + "/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
    assert bare["tokens"] == run.tokenizer.encode(text)
    back = httpx.post(server.base_url + "/detokenize", json={"tokens": bare["tokens"]}).json()
    assert back == {"prompt": text}


def test_next_token_gives_the_model_s_logits(server, run):
    out = httpx.post(server.base_url + "/next_token", json={"prompt": "To be", "top": 5}).json()
    ids = run.start_ids + run.tokenizer.encode("To be")
    logits = np.frombuffer(base64.b64decode(out["logits"]), dtype="<f4")
    assert logits.shape == (run.tokenizer.vocab_size,)
    raw = next_token_logits(run.model, ids).numpy()[:run.tokenizer.vocab_size]
    never = generation_excluded(run.tokenizer)  # no sample takes them: -inf, so the page charts what is drawn
    assert len(never) >= 2 and np.all(np.isneginf(logits[never]))
    drawn = np.setdiff1d(np.arange(len(raw)), never)
    assert np.allclose(logits[drawn], raw[drawn], atol=1e-5)
    expected = next_token_candidates(run.model, run.tokenizer, ids, top=5)
    assert [t["id"] for t in out["top"]] == [c.token_id for c in expected]
    assert [t["probability"] for t in out["top"]] == pytest.approx([c.probability for c in expected], abs=1e-6)


def test_health(server, run_dir):
    out = httpx.get(server.base_url + "/health").json()
    assert out["status"] == "ok" and out["model"] == run_dir.name
    assert out["scheduler"]["max_batch_size"] == 32


def test_an_ngram_run_is_served_too_and_its_zero_probabilities_stay_valid_json(run):
    """A counted trigram (maximum likelihood) gives most tokens probability 0: log p = -inf, which JSON
    cannot carry; the API writes -9999.0 for it, as OpenAI does."""
    model = counted_ngram(run.tokenizer)
    config = SimpleNamespace(model=dataclasses.replace(model.config, block_size=64))  # the run's setting
    ngram = type("NGramRun", (), {"model": model, "tokenizer": run.tokenizer, "config": config,
                                  "start_ids": run.start_ids, "path": "trigram"})
    with ThreadServer(ngram) as served:
        client = openai.OpenAI(base_url=served.base_url + "/v1", api_key="-", max_retries=0)
        out = client.completions.create(model="trigram", prompt="To be, or not", max_tokens=12, temperature=0,
                                        logprobs=8, echo=True)
        [expected] = library(SimpleNamespace(model=ngram.model, tokenizer=run.tokenizer, start_ids=run.start_ids),
                             "To be, or not", max_new_tokens=12, temperature=0)
        assert out.choices[0].text == "To be, or not" + expected.text
        alternatives = [v for top in out.choices[0].logprobs.top_logprobs[1:] for v in top.values()]
        assert -9999.0 in alternatives and all(math.isfinite(v) for v in alternatives)
        chart = httpx.post(served.base_url + "/next_token", json={"prompt": "To be, or", "top": 20}).json()
        top = chart["top"]  # only what a sample can take: the continuations the trigram has seen
        assert 0 < len(top) < 20 and all(t["probability"] > 0 and math.isfinite(t["logit"]) for t in top)
        assert sum(t["probability"] for t in top) == pytest.approx(1.0, abs=1e-6)
        # an n-gram has no window of its own; the run's block_size bounds a request, so a chat reply
        # without max_tokens ends within it
        assert client.models.list().data[0].model_extra["max_model_len"] == 64
        reply = client.chat.completions.create(model="trigram", messages=[{"role": "user", "content": "Speak"}],
                                               temperature=1.0, seed=0)
        assert reply.usage.total_tokens <= 64


def test_stream_lines_split_nowhere_inside_a_chunk(server):
    """A text holding U+2028, U+2029 or U+0085 (line breaks to Python's str.splitlines, and so to httpx's
    iter_lines): the chunks' JSON carries them escaped, so every line read is a whole ``data:`` line."""
    prompt = "a\u2028b\u2029c\u0085d"
    body = {"prompt": prompt, "max_tokens": 3, "echo": True, "stream": True, "temperature": 0}
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=30) as response:
        lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines), lines
    assert lines[-1] == "data: [DONE]"
    text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in lines[:-1])
    assert text.startswith(prompt)


class LoopWatchingTokenizer:
    """The run's tokenizer, noting every encode or decode that runs on an event loop's thread."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.on_loop: list[str] = []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _note(self, what: str) -> None:
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # a worker thread (or the scheduler's): fine
            return
        self.on_loop.append(what)

    def encode(self, text, *args, **kwargs):
        self._note("encode")
        return self.inner.encode(text, *args, **kwargs)

    def decode(self, ids, *args, **kwargs):
        self._note("decode")
        return self.inner.decode(ids, *args, **kwargs)


def test_tokenizing_never_runs_on_the_event_loop(run):
    """A long prompt takes a while to tokenize (0.6 s for 630 KB): on the event loop it would stall every stream
    the server is sending meanwhile. Every endpoint tokenizes and detokenizes in a worker thread."""
    tokenizer = LoopWatchingTokenizer(run.tokenizer)
    watched = SimpleNamespace(model=run.model, tokenizer=tokenizer, start_ids=run.start_ids, path="watched")
    with ThreadServer(watched) as served:
        url = served.base_url
        messages = [{"role": "user", "content": "Hi"}]
        assert httpx.post(url + "/tokenize", json={"prompt": "To be"}).status_code == 200
        assert httpx.post(url + "/tokenize", json={"messages": messages}).status_code == 200
        assert httpx.post(url + "/detokenize", json={"tokens": [70, 71]}).status_code == 200
        assert httpx.post(url + "/next_token", json={"prompt": "To be"}).status_code == 200
        body = {"prompt": "To be", "max_tokens": 2, "echo": True}
        assert httpx.post(url + "/v1/completions", json=body).status_code == 200
        assert httpx.post(url + "/v1/chat/completions", json={"messages": messages, "max_tokens": 2}).status_code == 200
    assert tokenizer.on_loop == []
