"""The OpenAI API: ``/v1/models``, ``/v1/completions`` and ``/v1/chat/completions``.

Each route reads what the app serves from ``request.app.state`` (`model`: the `ServedModel`, `chat`: its
`ChatFormat`, `scheduler`), turns the request into token ids and a `Job`, and leaves the answer to
`tinylm.serve.responses.respond`. A request may name the base or any adapter served beside it
(`tinylm.serve.adapters`): its job carries the adapter's index, and its answer the adapter's name.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

import tinylm.serve.protocol as protocol
from tinylm.serve.jobs import Job
from tinylm.serve.protocol import APIError, ChatRequest, CompletionRequest, fit_context
from tinylm.serve.responses import ChatCompletions, Completions, JobStream, respond

router = APIRouter()


@router.head("/v1/models", include_in_schema=False)  # GET without the body; the docs list GET alone
@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    return {"object": "list", "data": [served.card() for served in request.app.state.model.served()]}


@router.head("/v1/models/{model_id:path}", include_in_schema=False)  # GET without the body; the docs list GET alone
@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, request: Request) -> dict[str, Any]:
    if not model_id:  # GET /v1/models/ (a trailing slash) is the list, not a model named ""
        return await list_models(request)
    return request.app.state.model.check(model_id).card()


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    served = request.app.state.model.check(body.model)
    body.check_unsupported()
    prompts = await run_in_threadpool(body.prompt_ids, served.tokenizer)  # a long text takes a while
    echo = await run_in_threadpool(lambda: [served.tokenizer.decode(p) for p in prompts]) if body.echo else None
    n = body.n or 1
    if len(prompts) * n > protocol.MAX_CHOICES:
        raise APIError(400, f"{len(prompts)} prompts x n = {n} is {len(prompts) * n} completions; "
                       f"the most in one request is {protocol.MAX_CHOICES}", param="n")
    full = [served.start_ids + p for p in prompts]
    room = served.block_size - max(len(ids) for ids in full)  # at least one token, the prompt cut to make room
    max_tokens = (min(protocol.COMPLETIONS_DEFAULT_MAX_TOKENS, max(1, room)) if body.max_tokens is None
                  else body.max_tokens)
    # a prompt longer than fits keeps its last tokens (`tinylm.generate.steps.fit_prompt`), as `tinylm sample`
    full, warning = fit_context(full, max_tokens, served.block_size, echo=bool(body.echo))
    lengths = [len(ids) for ids in full]
    params = body.sampling_params(max_tokens)
    stream = JobStream(request.app.state.scheduler, whole=not body.stream)
    job = Job(full, params, on_event=stream.push, logprobs=body.logprobs,
              prompt_logprobs=bool(body.echo and body.logprobs is not None), echo_from=len(served.start_ids),
              adapter=served.adapter)
    result = Completions(served, job, prompt_tokens=sum(lengths), echo=echo, logprobs=body.logprobs is not None)
    return await respond(request, stream, job, result, body.stream, body.include_usage, warning)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatRequest, request: Request) -> Response:
    served, chat = request.app.state.model.check(body.model), request.app.state.chat
    body.check_unsupported()
    prompt = await run_in_threadpool(body.prompt_ids, chat)
    requested = body.requested_max_tokens
    max_tokens = max(1, served.block_size - len(prompt)) if requested is None else requested
    [prompt], warning = fit_context([prompt], max_tokens, served.block_size, what="messages")
    params = body.chat_sampling_params(max_tokens, chat)
    top = (body.top_logprobs or 0) if body.logprobs else None
    stream = JobStream(request.app.state.scheduler, whole=not body.stream)
    job = Job([prompt], params, on_event=stream.push, logprobs=top, adapter=served.adapter)
    result = ChatCompletions(served, job, prompt_tokens=len(prompt), logprobs=bool(body.logprobs))
    return await respond(request, stream, job, result, body.stream, body.include_usage, warning)
