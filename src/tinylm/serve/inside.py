"""The playground's "inside" view: how a text splits into tokens, and where the model's attention goes.

=============================  ==================================================================================
``POST /explain/tokens``       ``{text}`` -> the text's pieces: each token's id, its text and its bytes
``POST /explain/attention``    ``{text, layer?, head?}`` -> the tokens the model reads (the start ids, then the
                               text's) and their attention weights: every layer's (n_head, T, T), or one layer's
                               (n_head, T, T) with ``layer``, or one (T, T) map with ``layer`` and ``head``
=============================  ==================================================================================

Both read the text as ``/v1/completions`` reads a prompt: the model sees the run's start ids (BOS)
before the text's tokens, so those are in the attention maps too (marked ``"start": true``). Row i of
a map is how position i spreads its attention over positions 0..i (it sums to one); the entries
above the diagonal are the causal mask's zeros. The weights come from
`tinylm.generate.inspect.attention_maps` and the pieces from `Tokenizer.pieces`, so the page shows
what ``tinylm explain`` prints.

A bad request is a 400 in OpenAI's error JSON with one message: an empty text, a text longer than
the model's context, a layer or head the model does not have, a model with no attention (an
n-gram or LSTM run).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

import tinylm.serve.protocol as protocol
from tinylm.errors import TinyLMError
from tinylm.explain.attention import text_ids
from tinylm.generate.inspect import attention_maps
from tinylm.serve.protocol import APIError, ExplainAttentionRequest, ExplainTokensRequest

router = APIRouter()


def _piece(tokenizer: Any, token_id: int, data: bytes) -> dict[str, Any]:
    """One token for the page: its id, its text (``bytes:\\xe2\\x80`` for part of a character) and its bytes."""
    return {"id": token_id, "text": protocol.token_string(tokenizer, token_id), "bytes": list(data)}


def _check_text(text: str) -> None:
    if not text:
        raise APIError(400, "the text is empty: give the text to look inside", param="text")


def _check_range(name: str, value: int | None, count: int) -> None:
    if value is not None and value >= count:
        raise APIError(400, f"{name} {value} is out of range: this model has {count} {name}s, 0..{count - 1}",
                       param=name)


@router.post("/explain/tokens")
async def explain_tokens(body: ExplainTokensRequest, request: Request) -> dict[str, Any]:
    served = request.app.state.model
    served.check(body.model)
    _check_text(body.text)
    pieces = await run_in_threadpool(served.tokenizer.pieces, body.text)  # a long text takes a while
    return {"model": served.name, "count": len(pieces),
            "pieces": [_piece(served.tokenizer, i, data) for i, data in pieces]}


@router.post("/explain/attention")
async def explain_attention(body: ExplainAttentionRequest, request: Request) -> dict[str, Any]:
    served = request.app.state.model
    served.check(body.model)
    _check_text(body.text)
    if body.head is not None and body.layer is None:
        raise APIError(400, "head needs a layer: give layer too (or neither, for every layer's heads)", param="head")
    try:  # the start ids, then the text's: as /v1/completions builds a prompt (and `tinylm explain attention`)
        ids = await run_in_threadpool(text_ids, served.model, served.tokenizer, body.text, served.start_ids)
    except TinyLMError as e:  # longer than the context: attention_maps would show the map of its last part only
        raise APIError(400, str(e), param="text", code="context_length_exceeded") from None
    try:  # inference only, beside the scheduler (as /next_token)
        maps = await run_in_threadpool(lambda: [m.float().cpu() for m in attention_maps(served.model, ids)])
    except TinyLMError as e:  # an n-gram or LSTM model: attention_maps says which family has none
        raise APIError(400, str(e), code="no_attention") from None
    n_layer, n_head = len(maps), maps[0].shape[0]  # the checks after the maps: a model with no attention says so
    _check_range("layer", body.layer, n_layer)
    _check_range("head", body.head, n_head)
    weights: Any = [m.tolist() for m in maps]  # (n_layer, n_head, T, T)
    if body.layer is not None:
        weights = weights[body.layer]  # (n_head, T, T)
        if body.head is not None:
            weights = weights[body.head]  # (T, T)
    n_start = len(served.start_ids)
    tokens = [{**_piece(served.tokenizer, i, served.tokenizer.token_bytes(i)), "start": k < n_start}
              for k, i in enumerate(ids)]
    return {"model": served.name, "n_layer": n_layer, "n_head": n_head, "layer": body.layer,
            "head": body.head, "tokens": tokens, "weights": weights}
