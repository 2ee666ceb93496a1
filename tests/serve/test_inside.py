"""The inside view's endpoints: POST /explain/tokens and /explain/attention on the real `tinylm serve`.

The oracles are the library on the same run: `Tokenizer.pieces` for the pieces and
`tinylm.generate.inspect.attention_maps` over the prompt ids `/v1/completions` would read (the
start ids, then the text's). Properties pin the maps too: every row sums to one, nothing above
the diagonal (a query never sees a later key), and the first row is all on position 0, the only
key it has.
"""

from __future__ import annotations

from types import SimpleNamespace

import httpx
import pytest
import torch
from fastapi.testclient import TestClient
from servekit import counted_ngram

from tinylm.config import GPTConfig
from tinylm.generate.inspect import attention_maps
from tinylm.model import RecurrentLM
from tinylm.serve.app import create_app

TEXT = "Naïve café 🙂, to be"


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, timeout=60)


def test_tokens_are_the_tokenizer_s_pieces_and_join_to_the_text(server, run):
    response = post(server, "/explain/tokens", {"text": TEXT})
    assert response.status_code == 200, response.text
    body = response.json()
    expected = run.tokenizer.pieces(TEXT)
    assert [(p["id"], bytes(p["bytes"])) for p in body["pieces"]] == expected and body["count"] == len(expected)
    assert b"".join(bytes(p["bytes"]) for p in body["pieces"]).decode("utf-8") == TEXT
    # a piece that is part of a character is shown by its bytes, as logprobs show it
    partial = [p for p in body["pieces"] if not _is_utf8(bytes(p["bytes"]))]
    assert partial and all(p["text"].startswith("bytes:") for p in partial)


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def test_attention_is_the_library_s_maps_over_the_prompt_ids(server, run):
    ids = run.start_ids + run.tokenizer.encode(TEXT)
    expected = attention_maps(run.model, ids)  # per layer (n_head, T, T)
    body = post(server, "/explain/attention", {"text": TEXT}).json()
    assert [t["id"] for t in body["tokens"]] == ids
    n_start = len(run.start_ids)
    assert [t["start"] for t in body["tokens"]] == [True] * n_start + [False] * (len(ids) - n_start)
    assert (body["n_layer"], body["n_head"]) == (len(expected), expected[0].shape[0]) == (2, 4)
    weights = torch.tensor(body["weights"])  # (n_layer, n_head, T, T)
    torch.testing.assert_close(weights, torch.stack(expected).float(), rtol=0, atol=1e-6)
    T = len(ids)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 4, T))  # each row a distribution
    assert torch.all(weights.triu(1) == 0)  # causal: nothing above the diagonal
    assert torch.all(weights[..., 0, 0] == 1)  # the first query has one key, itself

    one_layer = post(server, "/explain/attention", {"text": TEXT, "layer": 1}).json()
    assert one_layer["layer"] == 1 and one_layer["head"] is None
    torch.testing.assert_close(torch.tensor(one_layer["weights"]), weights[1], rtol=0, atol=0)
    one_head = post(server, "/explain/attention", {"text": TEXT, "layer": 1, "head": 3}).json()
    torch.testing.assert_close(torch.tensor(one_head["weights"]), weights[1, 3], rtol=0, atol=0)


@pytest.mark.parametrize(("body", "param", "phrase"), [
    ({"text": ""}, "text", "the text is empty"),
    ({"text": "to be", "layer": 2}, "layer", "layer 2 is out of range: this model has 2 layers, 0..1"),
    ({"text": "to be", "layer": 0, "head": 4}, "head", "head 4 is out of range: this model has 4 heads, 0..3"),
    ({"text": "to be", "head": 1}, "head", "head needs a layer"),
    ({"text": "to be", "layer": -1}, "layer", "greater than or equal to 0"),
])
def test_bad_attention_requests_are_400_with_one_message(server, body, param, phrase):
    response = post(server, "/explain/attention", body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert phrase in error["message"] and error["param"] == param and error["type"] == "invalid_request_error"


def test_an_empty_text_has_no_pieces_to_show(server):
    response = post(server, "/explain/tokens", {"text": ""})
    assert response.status_code == 400 and "the text is empty" in response.json()["error"]["message"]


@pytest.mark.parametrize("family", ["ngram", "lstm"])
def test_a_model_without_attention_says_so(run, family):
    tok = run.tokenizer
    model = counted_ngram(tok) if family == "ngram" else RecurrentLM(GPTConfig(
        family="lstm", vocab_size=tok.vocab_size, block_size=64, n_layer=1, d_model=32, n_head=1)).eval()
    with TestClient(create_app(SimpleNamespace(model=model, tokenizer=tok, start_ids=run.start_ids))) as client:
        response = client.post("/explain/attention", json={"text": "to be"})
        assert response.status_code == 400
        assert response.json()["error"]["message"] == (
            f"{'an n-gram' if family == 'ngram' else 'an LSTM'} model has no attention to show; "
            "attention maps are the Transformer's")
        assert client.post("/explain/tokens", json={"text": "to be"}).status_code == 200  # the pieces still are
