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

A text longer than the model's context is read as every command reads one: its last block_size
tokens (the reply's ``warning`` says so; None when the whole text is read). A bad request is a 400 in
OpenAI's error JSON with one message: an empty text, a layer or head the model does not have, a model with no attention (an
n-gram or LSTM run). A text over `MAX_EXPLAIN_CHARS` characters, or an attention reply of more than
`MAX_ATTENTION_WEIGHTS` weights (every layer of a long text: ask for one layer, or one head), is a 413.
The work, and the writing of the reply (megabytes for a long text), is done in a worker thread
(`tinylm.serve.limits.HeavyLane`), so the server goes on answering the others meanwhile.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

import tinylm.serve.protocol as protocol
from tinylm.errors import TinyLMError
from tinylm.explain.attention import fit_text
from tinylm.generate.inspect import attention_maps
from tinylm.serve.limits import MAX_ATTENTION_WEIGHTS, MAX_EXPLAIN_CHARS, LimitExceeded, check_text
from tinylm.serve.protocol import APIError, ExplainAttentionRequest, ExplainTokensRequest

router = APIRouter()
log = logging.getLogger("uvicorn.error")  # where uvicorn logs what the apps it serves say


def _piece(tokenizer: Any, token_id: int, data: bytes) -> dict[str, Any]:
    """One token for the page: its id, its text (``bytes:\\xe2\\x80`` for part of a character) and its bytes."""
    return {"id": token_id, "text": protocol.token_string(tokenizer, token_id), "bytes": list(data)}


def _check_text(text: str, path: str) -> None:
    if not text:
        raise APIError(400, "the text is empty: give the text to look inside", param="text")
    check_text(text, MAX_EXPLAIN_CHARS, path)


def _check_range(name: str, value: int | None, count: int) -> None:
    if value is not None and value >= count:
        raise APIError(400, f"{name} {value} is out of range: this model has {count} {name}s, 0..{count - 1}",
                       param=name)


@router.post("/explain/tokens")
async def explain_tokens(body: ExplainTokensRequest, request: Request) -> Response:
    served = request.app.state.model.check(body.model)
    _check_text(body.text, "/explain/tokens")

    def explained() -> dict[str, Any]:
        pieces = served.tokenizer.pieces(body.text)
        seen: dict[int, dict[str, Any]] = {}  # a long text repeats its tokens: each is written out once
        for i, data in pieces:
            if i not in seen:
                seen[i] = _piece(served.tokenizer, i, data)
        return {"model": served.name, "count": len(pieces), "pieces": [seen[i] for i, _ in pieces]}

    return await request.app.state.heavy.reply(explained)


@router.post("/explain/attention")
async def explain_attention(body: ExplainAttentionRequest, request: Request) -> Response:
    served = request.app.state.model.check(body.model)
    _check_text(body.text, "/explain/attention")
    if body.head is not None and body.layer is None:
        raise APIError(400, "head needs a layer: give layer too (or neither, for every layer's heads)", param="head")
    return await request.app.state.heavy.reply(lambda: _attention(served, body))


def _attention(served: Any, body: ExplainAttentionRequest) -> dict[str, Any]:
    """The reply of /explain/attention (in a worker thread: the model runs, and the maps may be megabytes)."""
    # the start ids, then the text's: as /v1/completions builds a prompt; a text longer than the context keeps its
    # last block_size tokens, with the warning `tinylm explain attention` gives (in the reply, and logged)
    ids, warning = fit_text(served.model, served.tokenizer, body.text, served.start_ids)
    if warning is not None:
        log.warning(f"/explain/attention: {warning}")
    try:  # inference only, beside the scheduler (as /next_token)
        maps = [m.float().cpu() for m in served.call(attention_maps, served.model, ids)]
    except TinyLMError as e:  # an n-gram or LSTM model: attention_maps says which family has none
        raise APIError(400, str(e), code="no_attention") from None
    n_layer, n_head = len(maps), maps[0].shape[0]  # the checks after the maps: a model with no attention says so
    _check_range("layer", body.layer, n_layer)
    _check_range("head", body.head, n_head)
    chosen: Any = maps if body.layer is None else maps[body.layer]  # (n_layer, n_head, T, T) or (n_head, T, T)
    if body.layer is not None and body.head is not None:
        chosen = chosen[body.head]  # (T, T)
    count = sum(m.numel() for m in chosen) if body.layer is None else chosen.numel()
    if count > MAX_ATTENTION_WEIGHTS:
        fix = ("ask for one layer (layer), or one head (layer and head)" if body.layer is None else
               "ask for one head (head)" if body.head is None else "send a shorter text")
        raise LimitExceeded(413, f"these attention maps hold {count} weights; the most in one reply is "
                            f"{MAX_ATTENTION_WEIGHTS}: {fix}", code="reply_too_large", param="text")
    weights = [m.tolist() for m in chosen] if body.layer is None else chosen.tolist()
    n_start = len(served.start_ids) if warning is None else 0  # a cut text lost its start: the cut takes the oldest
    tokens = [{**_piece(served.tokenizer, i, served.tokenizer.token_bytes(i)), "start": k < n_start}
              for k, i in enumerate(ids)]
    return {"model": served.name, "n_layer": n_layer, "n_head": n_head, "layer": body.layer,
            "head": body.head, "tokens": tokens, "weights": weights, "warning": warning}
