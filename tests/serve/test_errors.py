"""Bad requests get OpenAI error JSON with the right status, never a 500; the API key gates the API."""

from __future__ import annotations

import httpx
import openai
import pytest
from servekit import ThreadServer

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "Hi"}]

# (endpoint, raw body or JSON, status, the parameter named, a phrase of the message or the error code)
BAD = [
    (COMPLETIONS, b'{"prompt": "To be", ', 400, None, "not valid JSON"),
    (COMPLETIONS, b"[1, 2, 3]", 400, None, "JSON object"),
    (COMPLETIONS, b'{"prompt": "\xff"}', 400, None, "do not decode as UTF-8 (invalid start byte at byte 12)"),
    (COMPLETIONS, b"[" * 100_000 + b"]" * 100_000, 400, None, "nests arrays or objects too deeply"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens", "valid integer"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": 2.5}, 400, "max_tokens", "valid integer"),
    (COMPLETIONS, {"prompt": "x", "temperature": "hot"}, 400, "temperature", "valid number"),
    (COMPLETIONS, {"prompt": "x", "n": True}, 400, "n", "valid integer"),
    (COMPLETIONS, {"prompt": "x", "stream": "yes"}, 400, "stream", "valid boolean"),
    (COMPLETIONS, {"prompt": 5}, 400, "prompt", "a string, a list of strings"),
    (COMPLETIONS, {"prompt": [1, "a"]}, 400, "prompt", "a string, a list of strings"),
    (COMPLETIONS, {"prompt": "x", "stop": 3}, 400, "stop", "a string or a list of strings"),
    (COMPLETIONS, {"prompt": "x", "temperature": -1}, 400, "temperature", "greater than or equal to 0"),
    (COMPLETIONS, {"prompt": "x", "top_p": 0}, 400, "top_p", "greater than or equal to 0.001"),
    # settings the sampling functions could not handle (an index out of bounds, inf/nan in the draw): refused
    (COMPLETIONS, {"prompt": "x", "top_p": 1e-6}, 400, "top_p", "greater than or equal to 0.001"),
    (COMPLETIONS, {"prompt": "x", "temperature": 1e-38}, 400, "temperature", "must be 0 (greedy decoding) or at least"),
    (CHAT, {"messages": USER, "temperature": 1e-4}, 400, "temperature", "must be 0 (greedy decoding) or at least"),
    (COMPLETIONS, {"prompt": "x", "temperature": 2.5}, 400, "temperature", "less than or equal to 2"),
    (COMPLETIONS, {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options",
     "only allowed when 'stream' is enabled"),
    (CHAT, {"messages": USER, "stream": False, "stream_options": {}}, 400, "stream_options",
     "only allowed when 'stream' is enabled"),
    (COMPLETIONS, {"prompt": "x", "n": 0}, 400, "n", "greater than or equal to 1"),
    (COMPLETIONS, {"prompt": "x", "logprobs": 21}, 400, "logprobs", "less than or equal to 20"),
    (COMPLETIONS, {"prompt": "x", "seed": -1}, 400, "seed", "greater than or equal to 0"),
    (COMPLETIONS, {"prompt": [10**6]}, 400, "prompt", "outside the vocabulary"),
    (COMPLETIONS, {"prompt": []}, 400, "prompt", "empty list"),
    (COMPLETIONS, {"prompt": "x", "n": 100, "max_tokens": 1, "echo": False} | {"prompt": ["a", "b"]}, 400, "n",
     "the most in one request"),
    (COMPLETIONS, {"prompt": "x", "presence_penalty": 0.5}, 400, "presence_penalty", "not supported"),
    (COMPLETIONS, {"prompt": "x", "logit_bias": {"5": 10}}, 400, "logit_bias", "not supported"),
    (COMPLETIONS, {"prompt": "x", "model": "gpt-4"}, 404, "model", "model_not_found"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": 65}, 400, "max_tokens", "context_length_exceeded"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": 10**9}, 400, "max_tokens", "context_length_exceeded"),
    (CHAT, {"messages": "Hi"}, 400, "messages", "valid list"),
    (CHAT, {}, 400, "messages", "messages is required"),
    (CHAT, {"messages": []}, 400, "messages", "messages is empty"),
    (CHAT, {"messages": [{"role": "bot", "content": "x"}]}, 400, "messages", "'user'"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, 400, "messages",
     "text only"),
    (CHAT, {"messages": USER, "tools": [{"type": "function"}]}, 400, "tools", "not supported"),
    (CHAT, {"messages": USER, "max_tokens": 200}, 400, "max_tokens", "context_length_exceeded"),
    (CHAT, {"messages": USER, "model": "nope"}, 404, "model", "model_not_found"),
    ("/tokenize", {"prompt": 3}, 400, "prompt", "valid string"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens", "ids in 0.."),
]


@pytest.mark.parametrize("path, body, status, param, phrase", BAD, ids=[f"{b[0]}:{b[4]}" for b in BAD])
def test_bad_requests_get_openai_errors(server, path, body, status, param, phrase):
    kwargs = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) \
        else {"json": body}
    response = httpx.post(server.base_url + path, timeout=30, **kwargs)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert phrase in error["message"] or phrase == error["code"], error


def test_oversized_bodies_get_413_whether_announced_or_not(server):
    big = b'{"prompt": "' + b"a" * (2 << 20) + b'"}'
    announced = httpx.post(server.base_url + COMPLETIONS, content=big, headers={"content-type": "application/json"})
    assert announced.status_code == 413 and announced.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: the limit must hold while reading
        for i in range(0, len(big), 65536):
            yield big[i:i + 65536]

    streamed = httpx.post(server.base_url + COMPLETIONS, content=chunks(), headers={"content-type": "application/json"})
    assert streamed.status_code == 413 and streamed.json()["error"]["code"] == "request_too_large"


def test_unknown_paths_and_methods_answer_in_json(server):
    missing = httpx.get(server.base_url + "/v1/engines")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    wrong = httpx.get(server.base_url + COMPLETIONS)
    assert wrong.status_code == 405 and wrong.json()["error"]["code"] == "method_not_allowed"
    assert wrong.headers["allow"] == "POST"  # HTTP asks a 405 to say which methods are allowed
    preflight = httpx.options(server.base_url + COMPLETIONS, headers={
        "Origin": "http://elsewhere.test", "Access-Control-Request-Method": "POST"})
    assert preflight.status_code == 405 and "access-control-allow-origin" not in preflight.headers  # no CORS unasked


def test_an_empty_body_is_called_empty(server):
    for body in (b"", b"  \n\t"):
        empty = httpx.post(server.base_url + COMPLETIONS, content=body, headers={"content-type": "application/json"})
        assert empty.status_code == 400 and empty.json()["error"]["message"] == (
            "the body is empty: send the request as a JSON object"), body


def test_allowed_origins_may_call_the_api_from_a_browser_with_its_key(run):
    """CORS as vLLM and llama.cpp's server offer it: the preflight passes the API key's gate (browsers send it
    without credentials), the answer names the origin, and an origin not listed gets no CORS headers."""
    with ThreadServer(run, api_key="s3cret", allow_origins=["http://localhost:3000"]) as served:
        url = served.base_url + COMPLETIONS
        preflight = httpx.options(url, headers={"Origin": "http://localhost:3000",
                                                "Access-Control-Request-Method": "POST",
                                                "Access-Control-Request-Headers": "authorization, content-type"})
        assert preflight.status_code == 200, preflight.text
        assert preflight.headers["access-control-allow-origin"] == "http://localhost:3000"
        assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
        headers = {"Origin": "http://localhost:3000", "Authorization": "Bearer s3cret"}
        answer = httpx.post(url, json={"prompt": "x", "max_tokens": 2}, headers=headers)
        assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == "http://localhost:3000"
        keyless = httpx.post(url, json={"prompt": "x"}, headers={"Origin": "http://localhost:3000"})
        assert keyless.status_code == 401  # CORS lets the page ask; the key still decides
        other = httpx.post(url, json={"prompt": "x", "max_tokens": 2},
                           headers={"Origin": "http://evil.test", "Authorization": "Bearer s3cret"})
        assert "access-control-allow-origin" not in other.headers


def test_the_openai_client_raises_its_own_error_classes(client, run_dir):
    with pytest.raises(openai.BadRequestError) as too_long:
        client.completions.create(model=run_dir.name, prompt="x", max_tokens=1000)
    assert too_long.value.code == "context_length_exceeded" and too_long.value.param == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=USER)
    with pytest.raises(openai.BadRequestError) as bad_type:
        client.completions.create(model=run_dir.name, prompt="x", extra_body={"top_k": "many"})
    assert bad_type.value.param == "top_k"


def test_after_all_that_the_server_still_serves_and_never_crashed(server, client, run_dir):
    assert client.completions.create(model=run_dir.name, prompt="x", max_tokens=3).choices[0].finish_reason
    log = server.stderr.read_text()
    assert "Traceback" not in log and "Exception in ASGI" not in log, log[-2000:]


def test_an_api_key_gates_the_api_but_not_the_page(run):
    with ThreadServer(run, api_key="s3cret") as served:
        api = served.base_url + "/v1"
        with pytest.raises(openai.AuthenticationError) as wrong:
            openai.OpenAI(base_url=api, api_key="guess", max_retries=0).models.list()
        assert wrong.value.status_code == 401 and wrong.value.code == "invalid_api_key"
        missing = httpx.post(api + "/completions", json={"prompt": "x"})
        assert missing.status_code == 401 and "didn't provide an API key" in missing.json()["error"]["message"]
        malformed = httpx.post(api + "/completions", content=b"{", headers={"content-type": "application/json"})
        assert malformed.status_code == 401  # the key is checked before anything else is looked at
        assert httpx.post(served.base_url + "/tokenize", json={"prompt": "x"}).status_code == 401
        # the scheme's name is case-insensitive (RFC 7235)
        for header in ("bearer s3cret", "BEARER s3cret", "Bearer  s3cret"):
            assert httpx.get(api + "/models", headers={"Authorization": header}).status_code == 200, header
        for header in ("Basic s3cret", "s3cret", "Bearer s3cret2", "Bearers3cret"):
            assert httpx.get(api + "/models", headers={"Authorization": header}).status_code == 401, header
        good = openai.OpenAI(base_url=api, api_key="s3cret", max_retries=0)
        assert good.completions.create(model=good.models.list().data[0].id, prompt="x", max_tokens=2).choices
        assert httpx.get(served.base_url + "/health").status_code == 200
        page = httpx.get(served.base_url + "/")
        assert page.status_code == 200 and "tinylm playground" in page.text


def test_a_body_sent_with_another_content_type_is_told_so(server):
    """curl -d sends application/x-www-form-urlencoded, and a body without a Content-Type is not read as JSON either
    (FastAPI's strict content type): 400, as OpenAI answers, with an error that says why."""
    body = b'{"prompt": "To be", "max_tokens": 2}'
    for kind in ("application/x-www-form-urlencoded", "text/plain", None):
        headers = {"content-type": kind} if kind else {}
        response = httpx.post(server.base_url + COMPLETIONS, content=body, headers=headers)
        assert response.status_code == 400, response.text
        message = response.json()["error"]["message"]
        assert "Content-Type: application/json" in message and (kind or "is missing") in message, message
    charset = {"content-type": "application/json; charset=utf-8"}
    assert httpx.post(server.base_url + COMPLETIONS, content=body, headers=charset).status_code == 200


def test_neutral_values_and_head_requests_are_accepted(server, client, run_dir):
    out = client.completions.create(model=run_dir.name, prompt="x", max_tokens=2, logit_bias={"5": 0, "7": 0.0})
    assert out.choices[0].finish_reason
    for path in ("/", "/v1/models", f"/v1/models/{run_dir.name}", "/health"):
        head, get = httpx.head(server.base_url + path), httpx.get(server.base_url + path)
        assert head.status_code == get.status_code == 200 and head.content == b"", path
        assert head.headers["content-type"] == get.headers["content-type"], path
