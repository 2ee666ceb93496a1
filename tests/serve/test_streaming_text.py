"""Streams carry whole characters only, and stop strings are never leaked, on a model that spells a known text.

The tokenizer is the bare byte-level one (one token per byte), so every accented letter, CJK
character and emoji arrives split over two to four tokens, and the model `ScriptedLM` says a
fixed text whatever the prompt.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import httpx
import pytest
from servekit import ScriptedLM, ThreadServer

from tinylm.serve.chat import chat_prompt
from tinylm.tokenizers import BPETokenizer

TOK = BPETokenizer([], pattern="gpt2")
START = [TOK.eos_id]
SAYS = "Naïve café 🙂 東京!\nUser: more"


def scripted_server(prompt_len: int, **options) -> ThreadServer:
    script = TOK.encode(SAYS) + [TOK.eos_id]
    run = SimpleNamespace(model=ScriptedLM(script, TOK.vocab_size, prompt_len), tokenizer=TOK, start_ids=START,
                          path="scripted")
    return ThreadServer(run, **options)


def sse_texts(response: httpx.Response, field=lambda choice: choice["text"]) -> list[str]:
    pieces = []
    for line in response.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            for choice in json.loads(line[6:])["choices"]:
                pieces.append(field(choice))
    return pieces


def test_every_streamed_piece_is_whole_characters():
    with scripted_server(prompt_len=len(START)) as served:
        body = {"prompt": "", "max_tokens": 60, "temperature": 0}
        whole = httpx.post(served.base_url + "/v1/completions", json=body).json()["choices"][0]
        assert whole == {"index": 0, "text": SAYS, "logprobs": None, "finish_reason": "stop"}
        with httpx.stream("POST", served.base_url + "/v1/completions", json={**body, "stream": True}) as response:
            pieces = sse_texts(response)
    assert "".join(pieces) == SAYS
    assert not any("\ufffd" in p for p in pieces)  # no half of a character ever went out as U+FFFD
    assert "🙂" in pieces or any("🙂" in p for p in pieces)  # four tokens, one piece
    assert len([p for p in pieces if p]) > 10  # it did stream, piece by piece


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_split_over_tokens_is_never_sent(stream):
    with scripted_server(prompt_len=len(START)) as served:
        body = {"prompt": "", "max_tokens": 60, "stop": ["🙂 東"], "stream": stream}
        if stream:
            with httpx.stream("POST", served.base_url + "/v1/completions", json=body) as response:
                text = "".join(sse_texts(response))
        else:
            out = httpx.post(served.base_url + "/v1/completions", json=body).json()
            text = out["choices"][0]["text"]
            assert out["choices"][0]["finish_reason"] == "stop"
            assert out["usage"]["completion_tokens"] == len(TOK.encode("Naïve café 🙂 東"))
    assert text == "Naïve café "


def test_chat_replies_stop_where_the_next_user_line_would_start():
    messages = [{"role": "user", "content": "Say something"}]
    prompt_len = len(START) + len(TOK.encode(chat_prompt(messages)))
    with scripted_server(prompt_len=prompt_len) as served:
        body = {"messages": messages, "temperature": 0}
        out = httpx.post(served.base_url + "/v1/chat/completions", json=body).json()
        assert out["choices"][0]["message"] == {"role": "assistant", "content": "Naïve café 🙂 東京!"}
        assert out["choices"][0]["finish_reason"] == "stop"
        with httpx.stream("POST", served.base_url + "/v1/chat/completions", json={**body, "stream": True}) as response:
            pieces = sse_texts(response, field=lambda choice: choice["delta"].get("content"))
    assert pieces[0] == "" and "".join(p for p in pieces if p) == "Naïve café 🙂 東京!"


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_start_where_the_reply_does(stream):
    """The reply's leading whitespace is dropped from its text, and its whitespace-only tokens from its logprobs:
    the logprobs' tokens, joined, are the reply (here every byte is a token: " ", "\\t", "\\n", " ", "H", ...)."""
    says = " \t\n Hi, café!"
    messages = [{"role": "user", "content": "Say something"}]
    prompt_len = len(START) + len(TOK.encode(chat_prompt(messages)))
    run = SimpleNamespace(model=ScriptedLM(TOK.encode(says) + [TOK.eos_id], TOK.vocab_size, prompt_len),
                          tokenizer=TOK, start_ids=START, path="scripted")
    body = {"messages": messages, "temperature": 0, "logprobs": True, "stream": stream}
    with ThreadServer(run) as served:
        if stream:
            with httpx.stream("POST", served.base_url + "/v1/chat/completions", json=body) as response:
                chunks = [json.loads(line[6:])["choices"][0] for line in response.iter_lines()
                          if line.startswith("data: {")]
            content = "".join(c["delta"].get("content") or "" for c in chunks)
            entries = [e for c in chunks if c["logprobs"] for e in c["logprobs"]["content"]]
            usage = None
        else:
            out = httpx.post(served.base_url + "/v1/chat/completions", json=body).json()
            content = out["choices"][0]["message"]["content"]
            entries = out["choices"][0]["logprobs"]["content"]
            usage = out["usage"]["completion_tokens"]
    assert content == "Hi, café!"
    assert bytes(b for e in entries for b in e["bytes"]).decode() == content
    if usage is not None:
        assert usage == len(TOK.encode(says)) + 1  # the dropped tokens and the end of text still count


def streamed_choices(served: ThreadServer, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", served.base_url + path, json={**body, "stream": True}) as response:
        return [json.loads(line[6:])["choices"][0] for line in response.iter_lines() if line.startswith("data: {")]


def test_logprobs_list_the_returned_text_s_tokens_alone_streamed_or_not():
    """The model says "Naïve café 🙂 東京!\\nUser: more": the stop string's tokens ("\\n", "U", "s", ...) and the
    end of text are generated (and counted) but their text is not returned, so they are not listed; the
    streamed chunks carry the same entries as the whole response."""
    said = "Naïve café 🙂 東京!"  # one token per byte (the bare byte-level tokenizer)
    with scripted_server(prompt_len=len(START)) as served:
        body = {"prompt": "", "max_tokens": 60, "temperature": 0, "stop": ["\nUser:"], "logprobs": 1}
        out = httpx.post(served.base_url + "/v1/completions", json=body).json()
        whole = out["choices"][0]
        assert whole["text"] == said and whole["finish_reason"] == "stop"
        lp = whole["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"]) == len(said.encode())
        assert max(lp["text_offset"]) < len(said)
        assert out["usage"]["completion_tokens"] == len((said + "\nUser:").encode())  # every drawn token counts
        chunks = streamed_choices(served, "/v1/completions", body)
        assert "".join(c["text"] for c in chunks) == said
        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            assert [v for c in chunks if c["logprobs"] for v in c["logprobs"][key]] == lp[key], key

        # a chat reply ends where the chat template's stop string "\nUser:" begins: so do its logprobs
        chat = {"messages": [{"role": "user", "content": "Hi"}], "temperature": 0, "logprobs": True}
        prompt_len = len(START) + len(TOK.encode(chat_prompt(chat["messages"])))
    with scripted_server(prompt_len=prompt_len) as served:
        reply = httpx.post(served.base_url + "/v1/chat/completions", json=chat).json()["choices"][0]
        entries = reply["logprobs"]["content"]
        assert reply["message"]["content"] == said
        assert bytes(b for e in entries for b in e["bytes"]).decode() == said
        chunks = streamed_choices(served, "/v1/chat/completions", chat)
        assert [e for c in chunks if c["logprobs"] for e in c["logprobs"]["content"]] == entries
