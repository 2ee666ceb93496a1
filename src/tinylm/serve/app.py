"""The HTTP app: an OpenAI-compatible API over a trained run, and the playground page.

`create_app(run)` returns a FastAPI (ASGI) app; `tinylm.serve.server.serve` runs it with uvicorn. The app
is put together here; the rest of the package holds its parts, one concern each:

==========================  ======================================================================
``routes_openai``           ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``
``routes_tokens``           ``/tokenize``, ``/detokenize``, ``/next_token``
``inside``                  ``/explain/tokens``, ``/explain/attention`` (the playground's inside view)
``routes_site``             ``/health``, the playground page and its files, ``/docs`` and ``/redoc``
``responses``               scheduler events -> OpenAI responses and server-sent events
``protocol``                request schemas and their checks, OpenAI's error and logprobs JSON
``middleware``              error answers, the crash guard, the API key gate, CORS
``options``                 the serving options' policy: their checks, the key from the environment
``limits``                  the body's size and time limits, the worker lane for heavy replies
``scheduler``, ``jobs``     the batching decoder the routes hand their jobs to
==========================  ======================================================================

The routes find what they serve in ``app.state``: ``model`` (a `ServedModel`), ``chat`` (its
`ChatFormat`), ``scheduler`` and ``heavy`` (the `HeavyLane`).

=========================  =========================================================================
``GET  /v1/models``        the model this server serves, and each LoRA adapter served beside it (and
                           ``GET /v1/models/{id}``; ``/v1/models/`` is the list too); ``HEAD`` answers
                           as ``GET`` does, without the body
``POST /v1/completions``   continue a prompt: text, texts, token ids; ``n``, ``stop``, ``seed``,
                           ``logprobs``, ``echo``, ``stream``, plus ``top_k`` and ``min_p``
``POST /v1/chat/completions``  messages through the model's chat template, or a plain-text transcript
                           (`tinylm.serve.chat`)
``GET  /health``           liveness, and the scheduler's counters (``HEAD /health``: the status alone)
``POST /tokenize``         text (or chat messages) -> token ids; ``POST /detokenize``: ids -> text
``POST /next_token``       the next-token distribution after a text (the playground's chart)
``POST /explain/tokens``   the playground's inside view: a text's token pieces, and (``/explain/attention``)
                           its attention maps (`tinylm.serve.inside`)
``GET  /``                 the playground: a prompt box, sliders, the streamed completion, the chart
=========================  =========================================================================

Every generation goes through one `Scheduler`, which batches the requests in flight. A
streaming response is server-sent events, one ``data: {json}`` chunk per piece of text (whole
characters only: the text streams of `tinylm.generate.stream` hold back partial UTF-8 and
possible stop strings), then ``data: [DONE]``. A generation that ends inside a character (its
``max_tokens`` ran out there, or the model emitted bytes that are not UTF-8) ends in U+FFFD, the
replacement character, streamed or not, as vLLM's does; the logprobs show those tokens' bytes. All
JSON, streamed or not, is written in ASCII (``\\u`` escapes, `protocol.json_text`), so that no
character in a text (U+2028, U+0085) can split a line for clients that read the stream line by line
with Unicode's line breaks (Python's ``str.splitlines``, httpx's ``iter_lines``), and a lone
surrogate a request sent (``"\\ud800"`` is valid JSON) can be quoted back in an error message.
When a client disconnects, its job is cancelled and its rows leave the batch at the next step,
streaming or not. A job that fails fails alone: its client gets the error (a 400 or 500
response, or an error chunk in its stream), the requests batched with it go on. When the server
shuts down (`tinylm.serve.server`), the requests still running get a 503 "the server is
shutting down" (or that error chunk, then ``[DONE]``).

**Logprobs and usage.** ``logprobs`` (``tokens``, ``token_logprobs``, ``top_logprobs``,
``text_offset``; chat's ``logprobs.content``) list exactly the tokens whose text is returned:
not the end-of-text token, not the tokens that only make up a stop string (a token straddling
the cut, whose text begins before it, is listed whole), and in a chat reply not the
whitespace-only tokens before its first visible character. Streamed, each chunk carries the
tokens whose text begins in it, so the chunks join to the whole response's lists. The usage's
``completion_tokens`` counts every token generated, listed or not (as OpenAI counts them). A
generated token's log-probability is under the distribution it was drawn from: the model's,
renormalised over the ids a sample may take (padding, BOS, reserved ids and ``<unk>`` never
are), as `tinylm sample` reports it and the playground charts it; an echoed prompt token's is the
model's over every id, as `tinylm eval` scores text.

Bad requests are answered with OpenAI error JSON and a 4xx status, never a 500 (see
`tinylm.serve.protocol`); a body larger than ``max_body_bytes`` gets 413 before it is read in
full, and one that has not arrived in full ``body_timeout`` seconds after the request began gets 408
(`tinylm.serve.limits`). A bug is a 500 in the same JSON, and the client's keep-alive connection stays
open for its next request (`tinylm.serve.middleware.CrashGuard`; in a stream, the error is a chunk, then ``[DONE]``).

With ``api_key`` set, the API (everything but the page, its files and /health: the interactive docs
and their /openapi.json too) answers 401 unless the request carries ``Authorization: Bearer <key>``,
as the OpenAI clients send it (the scheme's name in any case, RFC 7235). With ``allow_origins``, pages
from those web origins may call the API from a browser (CORS, preflight included); by default no other
origin may. Tokenizing and detokenizing run in worker threads, and so does the writing of the replies
that can be large (/tokenize, /detokenize, the inside view: `tinylm.serve.limits.HeavyLane`), so a long
prompt never holds up the event loop (and /health and the streams it serves).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from starlette.concurrency import run_in_threadpool

from tinylm.errors import TinyLMError
from tinylm.generate.prefix_cache import SERVE_BUDGET_MB
from tinylm.generate.speculative import load_draft
from tinylm.serve import inside, routes_openai, routes_site, routes_tokens
from tinylm.serve.adapters import LoraAdapter, ServedAdapters, check_adapters, find_adapters
from tinylm.serve.chat import ChatFormat
from tinylm.serve.limits import BODY_TIMEOUT, MAX_BODY_BYTES, HeavyLane
from tinylm.serve.middleware import JSON, add_error_handlers, add_middleware
from tinylm.serve.options import check_options
from tinylm.serve.scheduler import Scheduler
from tinylm.serve.served import ServedModel, served_context

__all__ = ["ServedModel", "create_app", "served_context"]


def create_app(run: Any, *, model_name: str | None = None, api_key: str | None = None, max_batch_size: int = 32,
               batch_window: float = 0.002, max_body_bytes: int = MAX_BODY_BYTES,
               body_timeout: float = BODY_TIMEOUT, allow_origins: Sequence[str] = (), draft: str | None = None,
               draft_k: int = 4,
               adapters: Mapping[str, str | os.PathLike] | Sequence[LoraAdapter] = (),
               prefix_cache_mb: float = SERVE_BUDGET_MB) -> FastAPI:
    """The app serving ``run`` (a `tinylm.run.Run`, or any object with model, tokenizer, start_ids).

    ``model_name`` is the id clients ask for (default: the run folder's name); ``api_key`` makes
    the API require it; ``max_batch_size`` and ``batch_window`` go to the `Scheduler`.
    ``allow_origins``: the web origins (``https://app.example``, or ``*`` for any) whose pages may
    call the API from a browser (CORS); none by default, so another site's page cannot.
    ``draft`` and ``draft_k``: speculative decoding of a lone request (`tinylm.generate.speculative.load_draft`
    names the drafts). ``max_body_bytes`` and ``body_timeout`` (seconds): the most a request's body may
    hold, and how long it may take to arrive (`tinylm.serve.limits`). A value that cannot be meant (an empty
    key or name, an origin with a path) is refused as `tinylm serve` refuses it (`tinylm.serve.options`).
    ``adapters``: LoRA adapters of the run's model to serve beside it, each under its own name ({name: folder},
    or `tinylm.serve.adapters.find_adapters`' list); they are stacked on ``run.model`` in place.
    ``prefix_cache_mb``: the memory kept for the keys and values of earlier requests, which a request that starts
    with the same tokens (a chat's next turn) reuses instead of recomputing (`tinylm.generate.prefix_cache`; 0: off).
    """
    check_options(api_key=api_key, model_name=model_name, body_timeout=body_timeout, allow_origins=allow_origins)
    path = getattr(run, "path", None)
    name = model_name or (Path(path).name if path else "tinylm")
    stacked = served_adapters(run, name, adapters) if adapters else None
    served = ServedModel(name=name, model=run.model, tokenizer=run.tokenizer, start_ids=list(run.start_ids),
                         block_size=served_context(run), adapters=stacked)
    drafter = load_draft(draft, run, log=lambda line: print(f"tinylm: {line}", file=sys.stderr)) if draft else None
    scheduler = Scheduler(run.model, run.tokenizer, max_batch_size=max_batch_size, batch_window=batch_window,
                          draft=drafter, draft_k=draft_k, adapters=stacked, prefix_cache_mb=prefix_cache_mb)
    heavy = HeavyLane()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        scheduler.start()
        try:
            yield
        finally:
            heavy.close()
            await run_in_threadpool(scheduler.close)

    # /docs and /redoc are `routes_site`'s, with their scripts served locally
    app = FastAPI(title="tinylm", summary="An OpenAI-compatible server for a tinylm run", lifespan=lifespan,
                  default_response_class=JSON, docs_url=None, redoc_url=None)
    app.state.model = served
    app.state.chat = ChatFormat(run.tokenizer, served.start_ids)
    app.state.scheduler = scheduler
    app.state.heavy = heavy
    add_error_handlers(app)
    add_middleware(app, api_key=api_key, allow_origins=allow_origins, max_body_bytes=max_body_bytes,
                   body_timeout=body_timeout)
    for routes in (routes_site, routes_openai, routes_tokens, inside):
        app.include_router(routes.router)
    routes_site.mount_files(app)
    return app


def served_adapters(run: Any, name: str,
                    adapters: Mapping[str, str | os.PathLike] | Sequence[LoraAdapter]) -> ServedAdapters:
    """The adapters, read (unless they are already) and checked against the run's checkpoint, stacked on its model."""
    found = find_adapters(adapters) if isinstance(adapters, Mapping) else list(adapters)
    checkpoint = getattr(run, "checkpoint", None)
    if checkpoint is None:
        raise TinyLMError("LoRA adapters adapt a network's checkpoint; this run has none (an n-gram run?)")
    check_adapters(found, checkpoint, name)
    return ServedAdapters(run.model, found)
