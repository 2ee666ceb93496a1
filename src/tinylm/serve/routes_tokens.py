"""Token-level endpoints beside the OpenAI API: ``/tokenize`` and ``/detokenize`` (as vLLM names them), and
``/next_token``, the next-token distribution the playground charts.

They read the served model from ``request.app.state.model``; the replies that can be large are built and
written in the app's `HeavyLane` (``request.app.state.heavy``), off the event loop.
"""

from __future__ import annotations

import base64
import logging
from typing import Any

import torch
from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

import tinylm.serve.protocol as protocol
from tinylm.generate.inspect import drawable_logits, top_ids
from tinylm.generate.steps import fit_prompt
from tinylm.serve.protocol import APIError, ChatRequest, DetokenizeRequest, NextTokenRequest, TokenizeRequest

router = APIRouter()
log = logging.getLogger("uvicorn.error")  # where uvicorn logs what the apps it serves say


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> Response:
    served, chat = request.app.state.model.check(body.model), request.app.state.chat
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give either prompt (text) or messages (a chat)", param="prompt")

    def tokenized() -> dict[str, Any]:  # in a worker thread: a long text takes a while, its reply too
        if body.messages is not None:  # the prompt /v1/chat/completions reads (a template writes its own BOS)
            ids = ChatRequest(messages=body.messages).prompt_ids(chat)
            if not (body.add_special_tokens or chat.template):
                ids = ids[len(served.start_ids):]
        else:
            ids = (served.start_ids if body.add_special_tokens else []) + served.tokenizer.encode(body.prompt)
        return {"tokens": ids, "count": len(ids), "max_model_len": served.block_size,
                "token_strs": [protocol.token_string(served.tokenizer, i) for i in ids]}

    return await request.app.state.heavy.reply(tokenized)


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> Response:
    served = request.app.state.model.check(body.model)

    def detokenized() -> dict[str, Any]:  # in a worker thread: a million ids take a while
        vocab = served.tokenizer.vocab_size
        if any(not 0 <= i < vocab for i in body.tokens):
            raise APIError(400, f"tokens must be ids in 0..{vocab - 1}", param="tokens")
        return {"prompt": served.tokenizer.decode(body.tokens)}

    return await request.app.state.heavy.reply(detokenized)


@router.post("/next_token")
async def next_token(body: NextTokenRequest, request: Request) -> dict[str, Any]:
    """The logits of the token after ``prompt`` (all of them, base64 float32 little-endian, so a page can
    apply any temperature and filter itself; -inf at the ids no sample takes) and the ``top`` most likely
    tokens at temperature 1."""
    served = request.app.state.model.check(body.model)
    ids = served.start_ids + await run_in_threadpool(served.tokenizer.encode, body.prompt)
    # the model reads the last block_size tokens (`fit_prompt`, as `tinylm next-token`); it runs beside the
    # scheduler (inference only)
    ids, warning = fit_prompt(ids, served.model.config.block_size)
    if warning is not None:
        log.warning(f"/next_token: {warning}")
    # -inf at the ids no sample takes (padding, BOS, reserved ids, <unk>), so the page charts what the server draws
    logits = (await run_in_threadpool(served.call, drawable_logits, served.model, served.tokenizer, ids)).cpu()  # (V,)
    probs = torch.softmax(logits, dim=-1)  # (V,)
    order = top_ids(logits, body.top)
    return {"model": served.name, "prompt_tokens": len(ids), "vocab_size": len(logits),
            "logits": base64.b64encode(logits.numpy().astype("<f4").tobytes()).decode("ascii"),
            "top": [{"id": i, "token": protocol.token_string(served.tokenizer, i),
                     "logit": protocol.finite(float(logits[i])),
                     "probability": float(probs[i])} for i in order], "warning": warning}
