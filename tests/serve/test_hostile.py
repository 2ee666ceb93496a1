"""Hostile input: no request gets a 500, and no answer, not even a bug's 500, costs the client its connection.

- Lone surrogates (``"\\ud800"``: valid JSON, but no UTF-8 can encode it) in the string fields, sent to the
  real `tinylm serve`: a 4xx error (or an answer, where the field is text), then the next request on the
  same keep-alive connection.
- Bugs injected into an in-process server (a tokenizer that raises an Exception, or a BaseException as a
  panic in a Rust tokenizer does): a 500 in OpenAI's error JSON, and the connection goes on serving.
- A hypothesis fuzz of every POST endpoint the server lists (its /openapi.json) over one connection: any
  JSON, raw bytes, and bodies with the right keys holding wrong types and values.
"""

from __future__ import annotations

import dataclasses
import http.client
import json

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from servekit import ThreadServer

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
VALID = (COMPLETIONS, '{"prompt": "To be", "max_tokens": 2, "seed": 0}')  # seeded: an unseeded draw may end at EOS
S = "\\ud800"  # a lone surrogate as JSON escapes it, inside the raw JSON text of a body
HI = '[{"role": "user", "content": "Hi"}]'


class KeepAlive:
    """One HTTP/1.1 connection to a server, kept alive: `post` fails if the server closed it after answering."""

    def __init__(self, base_url: str) -> None:
        self.url = httpx.URL(base_url)
        self.reopen()

    def reopen(self) -> None:
        self.connection = http.client.HTTPConnection(self.url.host, self.url.port, timeout=60)
        self.connection.connect()
        self.socket = self.connection.sock

    def post(self, path: str, body: str | bytes) -> tuple[int, bytes]:
        self.connection.request("POST", path, body=body.encode() if isinstance(body, str) else body,
                                headers={"Content-Type": "application/json"})
        response = self.connection.getresponse()
        data = response.read()
        # http.client drops the socket when the answer says "Connection: close"; a reset shows on the next request
        assert self.connection.sock is self.socket, f"the server closed the connection after {response.status}"
        return response.status, data

    def close(self) -> None:
        self.connection.close()

    def __enter__(self) -> KeepAlive:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def assert_openai_error(data: bytes, status: int) -> dict:
    error = json.loads(data)["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["type"] == ("server_error" if status >= 500 else "invalid_request_error"), error
    assert isinstance(error["message"], str) and error["message"], error
    return error


def assert_valid_request_succeeds(conn: KeepAlive) -> None:
    status, data = conn.post(*VALID)
    assert status == 200 and json.loads(data)["choices"][0]["finish_reason"] == "length", data


# ----- a million spaces, through the real command -------------------------------------------------


def test_a_prompt_of_a_million_spaces_is_answered_not_a_500(server, run):
    """tiktoken's split engine panics on such a run (a 500 on every endpoint that tokenizes, before). Spaces
    are the run that fits the 1 MiB body limit: a tab is two bytes of JSON, an ideographic space three."""
    prompt = " " * 999_999 + "x"
    with KeepAlive(server.base_url) as conn:
        status, data = conn.post("/tokenize", json.dumps({"prompt": prompt}))
        assert status == 200, data
        assert json.loads(data)["tokens"] == list(run.start_ids) + run.tokenizer.encode_reference(prompt)
        # far longer than the model's context: like every long prompt, its end is kept and the reply says so (a
        # completion keeps room for max_tokens; the next token is read from the last block_size tokens)
        block = run.model.config.block_size
        status, data = conn.post(COMPLETIONS, json.dumps({"prompt": prompt, "max_tokens": 2}))
        assert status == 200 and json.loads(data)["usage"]["prompt_tokens"] == block - 2, data[:200]
        status, data = conn.post("/next_token", json.dumps({"prompt": prompt}))
        reply = json.loads(data)
        assert status == 200 and reply["prompt_tokens"] == block, data[:200]
        assert f"keeping its last {block} tokens" in reply["warning"]
        assert_valid_request_succeeds(conn)


# ----- lone surrogates, through the real command --------------------------------------------------


# (endpoint, raw JSON text, the status it gets: the model's name is refused, text is encoded as the tokenizer does)
SURROGATES = [
    (COMPLETIONS, f'{{"prompt": "x", "max_tokens": 2, "model": "{S}"}}', 404),
    (CHAT, f'{{"messages": {HI}, "max_tokens": 2, "model": "{S}"}}', 404),
    ("/tokenize", f'{{"prompt": "x", "model": "{S}"}}', 404),
    ("/detokenize", f'{{"tokens": [1], "model": "{S}"}}', 404),
    ("/next_token", f'{{"prompt": "x", "model": "{S}"}}', 404),
    (COMPLETIONS, f'{{"prompt": "x{S}", "max_tokens": 2}}', 200),
    (COMPLETIONS, f'{{"prompt": ["{S}", "y"], "max_tokens": 2, "echo": true, "logprobs": 2}}', 200),
    (COMPLETIONS, f'{{"prompt": "x", "max_tokens": 2, "stop": "{S}"}}', 200),
    (COMPLETIONS, f'{{"prompt": "x", "max_tokens": 2, "stop": ["a", "{S}z"], "stream": true}}', 200),
    (COMPLETIONS, f'{{"prompt": "x", "max_tokens": 2, "user": "{S}"}}', 200),
    (COMPLETIONS, f'{{"prompt": "x", "max_tokens": 2, "{S}": 1}}', 200),  # an unknown field is ignored
    (COMPLETIONS, f'{{"prompt": "x", "max_tokens": 2, "suffix": "{S}"}}', 400),
    (COMPLETIONS, f'{{"prompt": "x", "max_tokens": 2, "logit_bias": {{"{S}": 1}}}}', 400),
    (COMPLETIONS, f'{{"prompt": "x", "max_tokens": 2, "logit_bias": {{"{S}": "a"}}}}', 400),
    (CHAT, f'{{"messages": [{{"role": "user", "content": "{S}"}}], "max_tokens": 2}}', 200),
    (CHAT, f'{{"messages": [{{"role": "user", "content": [{{"type": "text", "text": "{S}"}}]}}], "max_tokens": 2}}',
     200),
    (CHAT, f'{{"messages": [{{"role": "user", "content": "Hi", "name": "{S}"}}], "max_tokens": 2}}', 200),
    (CHAT, f'{{"messages": [{{"role": "{S}", "content": "Hi"}}], "max_tokens": 2}}', 400),
    (CHAT, f'{{"messages": [{{"role": "user", "content": [{{"type": "{S}"}}]}}], "max_tokens": 2}}', 400),
    (CHAT, f'{{"messages": {HI}, "max_tokens": 2, "user": "{S}", "stop": ["{S}"], "stream": true}}', 200),
    (CHAT, f'{{"messages": {HI}, "max_tokens": 2, "tool_choice": "{S}"}}', 400),
    ("/tokenize", f'{{"prompt": "{S}"}}', 200),
    ("/tokenize", f'{{"messages": [{{"role": "user", "content": "{S}"}}]}}', 200),
    ("/next_token", f'{{"prompt": "{S}{S}"}}', 200),
]


@pytest.mark.parametrize("path, body, status", SURROGATES, ids=[f"{p}:{b}" for p, b, _ in SURROGATES])
def test_a_lone_surrogate_is_answered_and_the_connection_goes_on(server, path, body, status):
    with KeepAlive(server.base_url) as conn:
        got, data = conn.post(path, body)
        assert got == status, data
        if status >= 400:
            error = assert_openai_error(data, status)
            if status == 404:  # the error names the model as it was sent
                assert error["code"] == "model_not_found" and "\ud800" in error["message"], error
        elif b'"stream": true' in body.encode():
            assert data.rstrip().endswith(b"data: [DONE]") and b'"error"' not in data, data
        assert_valid_request_succeeds(conn)


# ----- injected bugs, in an in-process server -------------------------------------------------------


BOOM = "<boom>"


class Panic(BaseException):
    """Stands in for pyo3's PanicException, what a panic in a Rust tokenizer (tiktoken) raises: a BaseException."""


class FaultyTokenizer:
    """The run's tokenizer with bugs to inject: encoding a text that holds `BOOM` raises ``error``; while
    ``bytes_error`` is set, `token_bytes` raises it (a stream's logprobs call it, in the event loop), and while
    ``decode_error`` is set, decoding a generated token does (in the scheduler's thread)."""

    def __init__(self, inner, error: BaseException) -> None:
        self.inner = inner
        self.error = error
        self.bytes_error: BaseException | None = None
        self.decode_error: BaseException | None = None

    def encode(self, text: str, **kwargs):
        if BOOM in text:
            raise self.error
        return self.inner.encode(text, **kwargs)

    def token_bytes(self, token_id: int) -> bytes:
        if self.bytes_error is not None:
            raise self.bytes_error
        return self.inner.token_bytes(token_id)

    def stream_decoder(self):
        return FaultyDecoder(self.inner.stream_decoder(), self)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


class FaultyDecoder:
    def __init__(self, inner, tokenizer: FaultyTokenizer) -> None:
        self.inner = inner
        self.tokenizer = tokenizer

    def push(self, token_id: int) -> str:
        if self.tokenizer.decode_error is not None:
            raise self.tokenizer.decode_error
        return self.inner.push(token_id)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


@pytest.mark.parametrize("error", [RuntimeError("an injected bug"), Panic("an injected panic")],
                         ids=["Exception", "BaseException"])
def test_a_bug_is_a_500_in_openai_json_and_the_connection_goes_on(run, error):
    tokenizer = FaultyTokenizer(run.tokenizer, error)
    with ThreadServer(dataclasses.replace(run, tokenizer=tokenizer)) as served, KeepAlive(served.base_url) as conn:
        for path, body in [(COMPLETIONS, {"prompt": BOOM, "max_tokens": 2}),
                           (CHAT, {"messages": [{"role": "user", "content": BOOM}], "max_tokens": 2}),
                           ("/tokenize", {"prompt": BOOM}), ("/next_token", {"prompt": BOOM})]:
            status, data = conn.post(path, json.dumps(body))
            assert status == 500, (path, data)
            message = assert_openai_error(data, 500)["message"]
            assert message == f"internal error: {type(error).__name__}: {error}", (path, message)
            assert_valid_request_succeeds(conn)


def test_a_bug_in_the_middle_of_a_stream_ends_it_with_an_error_chunk(run):
    """The 200 and the first bytes are out when the stream's code fails: the stream ends with the error as a
    chunk, then [DONE], as a failed generation's does, and the connection stays usable."""
    tokenizer = FaultyTokenizer(run.tokenizer, RuntimeError("unused"))
    with ThreadServer(dataclasses.replace(run, tokenizer=tokenizer)) as served, KeepAlive(served.base_url) as conn:
        assert_valid_request_succeeds(conn)
        tokenizer.bytes_error = Panic("token_bytes broke")  # the stream's logprobs look up each token's bytes
        status, data = conn.post(COMPLETIONS, '{"prompt": "To be", "max_tokens": 3, "logprobs": 1, "stream": true}')
        tokenizer.bytes_error = None
        assert status == 200, data
        events = [line[len("data: "):] for line in data.decode().splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]", events
        error = json.loads(events[-2])["error"]
        assert error["type"] == "server_error" and error["message"] == "internal error: Panic: token_bytes broke"
        assert_valid_request_succeeds(conn)


def test_a_panic_in_the_schedulers_thread_fails_that_request_and_the_server_goes_on(run):
    """A BaseException in a decoding step (a Rust tokenizer's panic) would end the scheduler's thread, and every
    request after it would wait forever: it fails the jobs in the batch, as an Exception does."""
    tokenizer = FaultyTokenizer(run.tokenizer, RuntimeError("unused"))
    with ThreadServer(dataclasses.replace(run, tokenizer=tokenizer)) as served, KeepAlive(served.base_url) as conn:
        tokenizer.decode_error = Panic("decoding broke")
        status, data = conn.post(*VALID)
        tokenizer.decode_error = None
        assert status == 500 and assert_openai_error(data, 500)["message"] == "generation failed: Panic: decoding broke"
        assert_valid_request_succeeds(conn)


# ----- the fuzz: every POST endpoint, one connection ------------------------------------------------


# pieces of text that have broken servers: lone surrogates (no UTF-8 holds them), NUL, line separators, the
# replacement character, characters beyond the BMP, the chat template's own markers, a special token's text
HOSTILE = ["\ud800", "\udfff", "\x00", "\u2028", "\ufffd", "\U0001f642", "東京", "\nUser:", "Assistant:", "<|eos|>"]
hostile = st.tuples(st.text(max_size=3), st.sampled_from(HOSTILE), st.text(max_size=3) | st.sampled_from(HOSTILE)).map(
    "".join)
texts = st.text(max_size=6) | hostile
ints = st.integers(-2, 5) | st.sampled_from([2**31, 2**63, 2**64, 10**30, -10**30])
floats = st.floats() | st.sampled_from([0.0, 1e-4, 0.5, 1.0, 2.0, 1e308])  # st.floats() gives NaN and inf too
scalars = st.none() | st.booleans() | ints | floats | texts
anything = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3),
                        max_leaves=8)

ids = st.integers(0, 299)  # the test run's vocabulary
small = st.integers(0, 3)  # max_tokens and n stay small, so that each request takes milliseconds
text_part = st.fixed_dictionaries({"type": st.just("text"), "text": texts})
odd_part = st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]) | texts},
                                 optional={"text": anything})
valid_message = st.fixed_dictionaries({"role": st.sampled_from(["system", "developer", "user", "assistant"])},
                                      optional={"content": texts | st.none() | st.lists(text_part, max_size=2),
                                                "name": texts})
odd_message = st.fixed_dictionaries({}, optional={"role": st.sampled_from(["tool", "bot", ""]) | anything,
                                                  "content": st.lists(odd_part, max_size=2) | anything})
messages = (st.lists(valid_message, min_size=1, max_size=3), st.lists(valid_message | odd_message, max_size=3))

# each field: (valid values, odd ones: of the right kind but out of range, empty, huge, NaN, another model's name)
MODEL = (st.just("tiny-run") | st.none(), texts)
SAMPLING = {
    "temperature": (st.floats(0, 2), floats), "top_p": (st.floats(0.001, 1), floats),
    "top_k": (st.integers(-1, 50), ints), "min_p": (st.floats(0, 1), floats), "n": (st.integers(1, 3), ints),
    "stop": (texts | st.lists(texts, max_size=3), st.lists(texts, max_size=20)),
    "seed": (st.integers(0, 2**63 - 1), ints), "stream": (st.booleans(), texts),
    "stream_options": (st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
                       st.dictionaries(texts, anything, max_size=2)),
    "presence_penalty": (st.just(0), floats), "frequency_penalty": (st.just(0.0), floats),
    "logit_bias": (st.dictionaries(ids.map(str), st.just(0), max_size=2), st.dictionaries(texts, floats, max_size=2)),
    "user": (texts, ints),
}
FIELDS = {  # endpoint: (the fields every body has, the optional ones)
    COMPLETIONS: ({"model": MODEL, "max_tokens": (small, ints),
                   "prompt": (texts | st.lists(texts, min_size=1, max_size=3) | st.lists(ids, min_size=1, max_size=4)
                              | st.lists(st.lists(ids, max_size=3), min_size=1, max_size=3),
                              st.lists(ints, max_size=3) | st.lists(st.lists(ints, max_size=2), max_size=2))},
                  {**SAMPLING, "logprobs": (st.integers(0, 5), ints), "echo": (st.booleans(), ints),
                   "best_of": (st.just(1), ints), "suffix": (st.just(""), texts)}),
    CHAT: ({"model": MODEL, "max_tokens": (small.map(lambda k: k + 1), ints), "messages": messages},
           {**SAMPLING, "max_completion_tokens": (st.integers(1, 3), ints), "logprobs": (st.booleans(), ints),
            "top_logprobs": (st.integers(0, 5), ints), "tools": (st.just([]), st.lists(anything, max_size=2)),
            "tool_choice": (st.sampled_from(["none", "auto"]), st.just("required") | texts),
            "response_format": (st.just({"type": "text"}), st.dictionaries(texts, texts, max_size=2))}),
    "/tokenize": ({"model": MODEL}, {"prompt": (texts, st.lists(texts, max_size=2)), "messages": messages,
                                     "add_special_tokens": (st.booleans(), ints)}),
    "/detokenize": ({"model": MODEL, "tokens": (st.lists(ids, max_size=6), st.lists(ints, max_size=6))}, {}),
    "/next_token": ({"model": MODEL}, {"prompt": (texts, ints), "top": (st.integers(1, 200), ints)}),
    "/explain/tokens": ({"text": (texts, ints)}, {"model": MODEL}),
    "/explain/attention": ({"text": (texts, ints)}, {"model": MODEL, "layer": (st.integers(0, 3), ints),
                                                      "head": (st.integers(0, 3), ints)}),
}


@st.composite
def structured(draw, path: str) -> dict:
    """A body with the endpoint's own fields, valid but for none to three of them (an odd value, any JSON or
    hostile text): a body that passes validation reaches the endpoint's own checks and generation; one that
    fails, a field's check. Shrinking goes towards fewer odd fields."""
    always, optional = FIELDS[path]
    fields = {**always, **optional}
    names = [*always, *(name for name in optional if draw(st.booleans()))]
    odd = set(draw(st.permutations(names))[:draw(st.sampled_from([0, 1, 1, 2, 3]))])
    body = {name: draw((fields[name][1] | hostile | anything) if name in odd else fields[name][0]) for name in names}
    if "stream_options" in body and "stream_options" not in odd:
        body["stream"] = True  # valid stream options come with a stream
    return body


def bodies(path: str) -> st.SearchStrategy[bytes]:
    """Raw bodies for an endpoint: mostly `structured` ones, one in eight any JSON or any bytes.

    The JSON is written as Python writes it: lone surrogates as escapes, NaN and Infinity as those words
    (Python's and so FastAPI's parser reads them)."""
    return st.integers(1, 16).flatmap(lambda k: st.binary(max_size=24) if k == 1 else
                                      (anything if k == 2 else structured(path)).map(lambda b: json.dumps(b).encode()))


def post_paths(base_url: str) -> set[str]:
    return {path for path, operations in httpx.get(base_url + "/openapi.json").json()["paths"].items()
            if "post" in operations}


def test_the_fuzz_covers_every_post_endpoint(server):
    assert post_paths(server.base_url) == set(FIELDS)


def test_fuzzed_bodies_never_get_a_5xx_nor_cost_the_connection(server):
    conn = KeepAlive(server.base_url)
    log_start = len(server.stderr.read_text())

    @settings(max_examples=300, deadline=None)
    @given(request=st.sampled_from(sorted(FIELDS)).flatmap(lambda path: st.tuples(st.just(path), bodies(path))))
    def check(request):
        path, body = request
        try:
            status, data = conn.post(path, body)
            assert status < 500, (status, data)
            if status >= 400:
                assert_openai_error(data, status)
            elif data.startswith(b"data: "):  # a stream: no chunk may carry a server error
                assert data.rstrip().endswith(b"data: [DONE]") and b'"server_error"' not in data, data
            else:
                json.loads(data)
            assert conn.post("/tokenize", '{"prompt": "ok"}')[0] == 200
        except BaseException:
            conn.reopen()  # the next example starts on a live connection, so this failure stays this example's
            raise

    try:
        check()
        assert_valid_request_succeeds(conn)
    finally:
        conn.close()
    log = server.stderr.read_text()[log_start:]
    assert "Traceback" not in log, log[-3000:]
