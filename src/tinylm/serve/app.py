"""The HTTP app: an OpenAI-compatible API over a trained run, and the playground page.

`create_app(run)` returns a FastAPI (ASGI) app; `tinylm.serve.server.serve` runs it with uvicorn.

=========================  =========================================================================
``GET  /v1/models``        the one model this server serves (and ``GET /v1/models/{id}``; ``/v1/models/``
                           is the list too); ``HEAD`` answers as ``GET`` does, without the body
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
open for its next request (`_CrashGuard`; in a stream, the error is a chunk, then ``[DONE]``).

With ``api_key`` set, the API (everything but the page, its files and /health: the interactive docs
and their /openapi.json too) answers 401 unless the request carries ``Authorization: Bearer <key>``,
as the OpenAI clients send it (the scheme's name in any case, RFC 7235). With ``allow_origins``, pages
from those web origins may call the API from a browser (CORS, preflight included); by default no other
origin may. Tokenizing and detokenizing run in worker threads, and so does the writing of the replies
that can be large (/tokenize, /detokenize, the inside view: `tinylm.serve.limits.HeavyLane`), so a long
prompt never holds up the event loop (and /health and the streams it serves).
"""

from __future__ import annotations

import asyncio
import base64
import hmac
import importlib.resources
import logging
import math
import sys
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

import tinylm.serve.protocol as protocol
from tinylm.errors import TinyLMError
from tinylm.generate.inspect import drawable_logits, top_ids
from tinylm.generate.speculative import load_draft
from tinylm.generate.steps import fit_prompt
from tinylm.serve.chat import ChatFormat, is_blank_token, reply_text
from tinylm.serve.inside import router as inside_router
from tinylm.serve.protocol import (
    APIError,
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    NextTokenRequest,
    TokenizeRequest,
    fit_context,
)
from tinylm.serve.jobs import ChoiceEvent, Job, JobDone, JobFailed, PromptEvent, TokenLogprob, is_crash
from tinylm.serve.limits import BODY_TIMEOUT, MAX_BODY_BYTES, BodyGuard, HeavyLane, LimitExceeded
from tinylm.serve.scheduler import Scheduler

STATIC = Path(__file__).parent / "static"
# Swagger UI's and ReDoc's own files, for /docs and /redoc, from the fastapi-offline package (which ships them)
DOCS_ASSETS = Path(importlib.resources.files("fastapi_offline") / "static")
DOCS_ASSETS_URL = "/static/docs"
# no API key needed: the page, its files, liveness (not the docs: they and /openapi.json lay the API out, so a
# key guards them as it guards the API)
OPEN_PATHS = {"/", "/health"}
OPEN_PREFIXES = ("/static/",)
log = logging.getLogger("uvicorn.error")  # where uvicorn logs the errors of the apps it serves


@dataclass
class ServedModel:
    """What the endpoints need from a loaded run (`tinylm.run.Run` or anything with these attributes)."""

    name: str
    model: torch.nn.Module
    tokenizer: Any
    start_ids: list[int]
    block_size: int
    created: int = field(default_factory=protocol.now)

    def check(self, requested: str | None) -> None:
        if requested is not None and requested != self.name:
            raise APIError(404, f"The model '{requested}' does not exist; this server serves '{self.name}'",
                           param="model", code="model_not_found")

    def card(self) -> dict[str, Any]:
        return {"id": self.name, "object": "model", "created": self.created, "owned_by": "tinylm",
                "max_model_len": self.block_size}


def served_context(run: Any) -> int:
    """The most tokens a request may hold (prompt plus max_tokens): the model's context window.

    An n-gram model has no window of its own (it reads its last n-1 tokens), so the run's
    configured ``block_size`` bounds its requests instead, which also keeps a chat reply without
    ``max_tokens`` from running on without end.
    """
    config = getattr(run, "config", None)
    if config is not None and config.model.family == "ngram":
        return config.model.block_size
    return run.model.config.block_size


def create_app(run: Any, *, model_name: str | None = None, api_key: str | None = None, max_batch_size: int = 32,
               batch_window: float = 0.002, max_body_bytes: int = MAX_BODY_BYTES,
               body_timeout: float = BODY_TIMEOUT, allow_origins: Sequence[str] = (), draft: str | None = None,
               draft_k: int = 4) -> FastAPI:
    """The app serving ``run`` (a `tinylm.run.Run`, or any object with model, tokenizer, start_ids).

    ``model_name`` is the id clients ask for (default: the run folder's name); ``api_key`` makes
    the API require it; ``max_batch_size`` and ``batch_window`` go to the `Scheduler`.
    ``allow_origins``: the web origins (``https://app.example``, or ``*`` for any) whose pages may
    call the API from a browser (CORS); none by default, so another site's page cannot.
    ``draft`` and ``draft_k``: speculative decoding of a lone request (`tinylm.generate.speculative.load_draft`
    names the drafts). ``max_body_bytes`` and ``body_timeout`` (seconds): the most a request's body may
    hold, and how long it may take to arrive (`tinylm.serve.limits`).
    """
    if not 0 < body_timeout < math.inf:
        raise TinyLMError(f"body_timeout is {body_timeout}: give the seconds a request's body may take to arrive "
                          "(more than 0)")
    if api_key is not None and not api_key.strip():
        raise TinyLMError("the API key is empty: give the key clients must send, or None for no key")
    if model_name is not None and not model_name.strip():
        raise TinyLMError("the model name is empty: give the id clients ask for, or None for the run folder's name")
    path = getattr(run, "path", None)
    served = ServedModel(name=model_name or (Path(path).name if path else "tinylm"), model=run.model,
                   tokenizer=run.tokenizer, start_ids=list(run.start_ids), block_size=served_context(run))
    chat = ChatFormat(run.tokenizer, served.start_ids)
    drafter = load_draft(draft, run, log=lambda line: print(f"tinylm: {line}", file=sys.stderr)) if draft else None
    scheduler = Scheduler(run.model, run.tokenizer, max_batch_size=max_batch_size, batch_window=batch_window,
                          draft=drafter, draft_k=draft_k)

    heavy = HeavyLane()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        scheduler.start()
        try:
            yield
        finally:
            heavy.close()
            await run_in_threadpool(scheduler.close)

    # FastAPI's own /docs and /redoc pages load their scripts from a CDN, so offline they are blank; ours below
    # are the same pages with the scripts served from the installed package
    app = FastAPI(title="tinylm", summary="An OpenAI-compatible server for a tinylm run", lifespan=lifespan,
                  default_response_class=_JSON, docs_url=None, redoc_url=None)
    app.state.scheduler = scheduler
    app.state.model = served
    app.state.heavy = heavy
    _add_error_handlers(app)
    app.add_middleware(BodyGuard, max_bytes=max_body_bytes, timeout=body_timeout)
    if api_key:
        app.add_middleware(_APIKeyGate, key=api_key)
    app.add_middleware(_CrashGuard)  # inside CORS, so that a browser's page can read a 500 too
    if allow_origins:  # added last, so it runs first: a browser's preflight carries no API key
        app.add_middleware(CORSMiddleware, allow_origins=list(allow_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"], expose_headers=[protocol.WARNING_HEADER])

    @app.api_route("/health", methods=["GET", "HEAD"])  # HEAD: load balancers' and monitors' liveness probe
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": served.name, "scheduler": scheduler.stats()}

    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [served.card()]}

    @app.api_route("/v1/models/{model_id:path}", methods=["GET", "HEAD"])
    async def retrieve_model(model_id: str) -> dict[str, Any]:
        if not model_id:  # GET /v1/models/ (a trailing slash) is the list, not a model named ""
            return await list_models()
        served.check(model_id)
        return served.card()

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        served.check(body.model)
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
        stream = _JobStream(scheduler)
        job = Job(full, params, on_event=stream.push, logprobs=body.logprobs,
                  prompt_logprobs=bool(body.echo and body.logprobs is not None), echo_from=len(served.start_ids))
        result = _Completions(served, job, prompt_tokens=sum(lengths), echo=echo, logprobs=body.logprobs is not None)
        return await _respond(request, stream, job, result, body.stream, body.include_usage, warning)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request) -> Response:
        served.check(body.model)
        body.check_unsupported()
        prompt = await run_in_threadpool(body.prompt_ids, chat)
        requested = body.requested_max_tokens
        max_tokens = max(1, served.block_size - len(prompt)) if requested is None else requested
        [prompt], warning = fit_context([prompt], max_tokens, served.block_size, what="messages")
        params = body.chat_sampling_params(max_tokens, chat)
        top = (body.top_logprobs or 0) if body.logprobs else None
        stream = _JobStream(scheduler)
        job = Job([prompt], params, on_event=stream.push, logprobs=top)
        result = _ChatCompletions(served, job, prompt_tokens=len(prompt), logprobs=bool(body.logprobs))
        return await _respond(request, stream, job, result, body.stream, body.include_usage, warning)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> Response:
        served.check(body.model)
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

        return await heavy.reply(tokenized)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> Response:
        served.check(body.model)

        def detokenized() -> dict[str, Any]:  # in a worker thread: a million ids take a while
            vocab = served.tokenizer.vocab_size
            if any(not 0 <= i < vocab for i in body.tokens):
                raise APIError(400, f"tokens must be ids in 0..{vocab - 1}", param="tokens")
            return {"prompt": served.tokenizer.decode(body.tokens)}

        return await heavy.reply(detokenized)

    @app.post("/next_token")
    async def next_token(body: NextTokenRequest) -> dict[str, Any]:
        """The logits of the token after ``prompt`` (all of them, base64 float32 little-endian, so a page can
        apply any temperature and filter itself; -inf at the ids no sample takes) and the ``top`` most likely
        tokens at temperature 1."""
        served.check(body.model)
        ids = served.start_ids + await run_in_threadpool(served.tokenizer.encode, body.prompt)
        # the model reads the last block_size tokens (`fit_prompt`, as `tinylm next-token`); it runs beside the
        # scheduler (inference only)
        ids, warning = fit_prompt(ids, served.model.config.block_size)
        if warning is not None:
            log.warning(f"/next_token: {warning}")
        # -inf at the ids no sample takes (padding, BOS, reserved ids, <unk>), so the page charts what the server draws
        logits = (await run_in_threadpool(drawable_logits, served.model, served.tokenizer, ids)).cpu()  # (V,)
        probs = torch.softmax(logits, dim=-1)  # (V,)
        order = top_ids(logits, body.top)
        return {"model": served.name, "prompt_tokens": len(ids), "vocab_size": len(logits),
                "logits": base64.b64encode(logits.numpy().astype("<f4").tobytes()).decode("ascii"),
                "top": [{"id": i, "token": protocol.token_string(served.tokenizer, i),
                         "logit": protocol.finite(float(logits[i])),
                         "probability": float(probs[i])} for i in order], "warning": warning}

    app.include_router(inside_router)  # /explain/tokens, /explain/attention

    @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
    async def page() -> FileResponse:
        return FileResponse(STATIC / "index.html")

    @app.get("/docs", include_in_schema=False)
    async def docs() -> Response:
        return get_swagger_ui_html(openapi_url=app.openapi_url, title="tinylm: the API",
                                   swagger_js_url=f"{DOCS_ASSETS_URL}/swagger-ui-bundle.js",
                                   swagger_css_url=f"{DOCS_ASSETS_URL}/swagger-ui.css",
                                   swagger_favicon_url=f"{DOCS_ASSETS_URL}/favicon.png")

    @app.get("/redoc", include_in_schema=False)
    async def redoc() -> Response:
        return get_redoc_html(openapi_url=app.openapi_url, title="tinylm: the API",
                              redoc_js_url=f"{DOCS_ASSETS_URL}/redoc.standalone.js",
                              redoc_favicon_url=f"{DOCS_ASSETS_URL}/favicon.png", with_google_fonts=False)

    # under /static/, which the API key leaves open like the page's own files; mounted first, so it wins
    app.mount(DOCS_ASSETS_URL, StaticFiles(directory=DOCS_ASSETS), name="docs-assets")
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    return app


# ----- from scheduler events to responses ----------------------------------------------------------


class _JobStream:
    """A job's events, handed from the scheduler's thread to this request's event loop."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[list] = asyncio.Queue()

    def push(self, events: list) -> None:  # called on the scheduler's thread
        self.loop.call_soon_threadsafe(self.queue.put_nowait, events)

    async def events(self) -> AsyncIterator[ChoiceEvent | PromptEvent]:
        while True:
            for event in await self.queue.get():
                if isinstance(event, JobDone):
                    return
                if isinstance(event, JobFailed):
                    if event.status == 503:  # the server is shutting down: nothing failed
                        raise APIError(503, event.message, code="server_shutting_down")
                    raise APIError(event.status, f"generation failed: {event.message}")
                yield event


@dataclass
class _Choice:
    text: str = ""
    tokens: list[TokenLogprob] = field(default_factory=list)  # listed tokens (their text is returned)
    unsent: list[TokenLogprob] = field(default_factory=list)  # streaming: tokens not in a chunk yet
    unsent_text: str = ""  # streaming: text not in a chunk yet
    finish_reason: str | None = None
    started: bool = False  # streaming: a chunk was sent (chat: the reply's first visible text)
    visible: bool = False  # chat: a token with a visible character was generated (see `_ChatCompletions.shows`)


class _Result:
    """Collects a job's events and writes them as one response or as stream chunks (per endpoint)."""

    kind: str  # the response's "object"
    chunk_kind: str  # a stream chunk's "object"
    id_prefix: str

    def __init__(self, served: ServedModel, job: Job, prompt_tokens: int, logprobs: bool) -> None:
        self.served = served
        self.tokenizer = served.tokenizer
        self.id = protocol.new_id(self.id_prefix)
        self.created = protocol.now()
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = 0
        self.logprobs = logprobs
        self.choices = [_Choice() for _ in range(len(job.prompts) * job.n)]
        self.n = job.n

    def add(self, event: ChoiceEvent | PromptEvent) -> _Choice | None:
        """Record an event; the choice it advanced (None for a prompt event)."""
        if isinstance(event, PromptEvent):
            return None
        choice = self.choices[event.index]
        choice.text += event.text
        choice.unsent_text += event.text
        self.completion_tokens += event.generated  # a stop token or a stop string's tokens count, as OpenAI's do
        for token in event.tokens:  # the tokens whose text begins in the text released so far
            if self.shows(choice, token):
                choice.tokens.append(token)
                choice.unsent.append(token)
        choice.finish_reason = event.finish_reason
        return choice

    def shows(self, choice: _Choice, token: TokenLogprob) -> bool:
        """Whether a generated token goes into the choice's logprobs."""
        return True

    def envelope(self, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.served.name,
                "system_fingerprint": None, "choices": choices}

    def usage(self) -> dict[str, int]:
        return protocol.usage(self.prompt_tokens, self.completion_tokens)

    def response(self) -> dict[str, Any]:
        body = self.envelope(self.kind, [self.final_choice(i, c) for i, c in enumerate(self.choices)])
        return {**body, "usage": self.usage()}

    def final_choice(self, index: int, choice: _Choice) -> dict[str, Any]:
        raise NotImplementedError

    def start_chunks(self) -> list[dict[str, Any]]:
        """Chunks to send before any token (chat: the assistant role)."""
        return []

    def chunk_choice(self, index: int, choice: _Choice) -> dict[str, Any] | None:
        """The chunk for what a choice gained since its last chunk, or None if there is nothing to send yet."""
        raise NotImplementedError


class _Completions(_Result):
    kind = chunk_kind = "text_completion"
    id_prefix = "cmpl"

    def __init__(self, served: ServedModel, job: Job, prompt_tokens: int, echo: list[str] | None,
                 logprobs: bool) -> None:
        super().__init__(served, job, prompt_tokens, logprobs)
        self.echo = echo
        self.prompt_logprobs: dict[int, tuple[TokenLogprob, ...]] = {}

    def add(self, event: ChoiceEvent | PromptEvent) -> _Choice | None:
        if isinstance(event, PromptEvent):
            self.prompt_logprobs[event.prompt_index] = event.tokens
        return super().add(event)

    def _prefix(self, index: int) -> str:
        return self.echo[index // self.n] if self.echo is not None else ""

    def _logprobs(self, index: int, tokens: list[TokenLogprob], with_prompt: bool) -> dict[str, list] | None:
        """The legacy logprobs of ``tokens`` (offsets after the echoed prompt), after the prompt's own if asked."""
        if not self.logprobs:
            return None
        prompt = self.prompt_logprobs.get(index // self.n, ()) if with_prompt else ()  # filled with echo only
        head = protocol.completion_logprobs(self.tokenizer, prompt)
        tail = protocol.completion_logprobs(self.tokenizer, tokens, offset=len(self._prefix(index)))
        return {key: head[key] + tail[key] for key in head}

    def final_choice(self, index: int, choice: _Choice) -> dict[str, Any]:
        return {"index": index, "text": self._prefix(index) + choice.text,
                "logprobs": self._logprobs(index, choice.tokens, with_prompt=True),
                "finish_reason": choice.finish_reason}

    def chunk_choice(self, index: int, choice: _Choice) -> dict[str, Any] | None:
        text, choice.unsent_text = choice.unsent_text, ""
        first = not choice.started
        if not (text or choice.finish_reason or (first and self.echo)):
            return None
        choice.started = True
        tokens, choice.unsent = choice.unsent, []
        return {"index": index, "text": (self._prefix(index) if first else "") + text,
                "logprobs": self._logprobs(index, tokens, with_prompt=first), "finish_reason": choice.finish_reason}


class _ChatCompletions(_Result):
    kind = "chat.completion"
    chunk_kind = "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def shows(self, choice: _Choice, token: TokenLogprob) -> bool:
        """The reply's text starts at its first visible character (`reply_text`), and so do its logprobs: the
        whitespace-only tokens before it are left out (counted in the usage all the same). The first token
        kept is shown whole, so its text may begin with the whitespace the reply's text drops (" Hello")."""
        if not choice.visible:
            choice.visible = not is_blank_token(self.tokenizer.token_bytes(token.id))
        return choice.visible

    def _logprobs(self, tokens: list[TokenLogprob]) -> dict[str, list] | None:
        return protocol.chat_logprobs(self.tokenizer, tokens) if self.logprobs else None

    def final_choice(self, index: int, choice: _Choice) -> dict[str, Any]:
        return {"index": index, "message": {"role": "assistant", "content": reply_text(choice.text)},
                "logprobs": self._logprobs(choice.tokens), "finish_reason": choice.finish_reason}

    def start_chunks(self) -> list[dict[str, Any]]:
        return [self.envelope(self.chunk_kind, [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                   "logprobs": None, "finish_reason": None}])
                for i in range(len(self.choices))]

    def chunk_choice(self, index: int, choice: _Choice) -> dict[str, Any] | None:
        text, choice.unsent_text = choice.unsent_text, ""
        if not choice.started:
            text = reply_text(text)  # the reply starts at its first visible character
            choice.started = bool(text)
        if not (text or choice.finish_reason):
            return None
        tokens, choice.unsent = choice.unsent, []
        delta = {"content": text} if text else {}
        return {"index": index, "delta": delta, "logprobs": self._logprobs(tokens),
                "finish_reason": choice.finish_reason}


async def _respond(request: Request, stream: _JobStream, job: Job, result: _Result, streaming: bool | None,
                   include_usage: bool, warning: str | None = None) -> Response:
    """Submit the job; answer with the whole result, or stream it as server-sent events. ``warning`` (a prompt
    cut to fit) is logged and sent in the `protocol.WARNING_HEADER` header: the bodies keep OpenAI's shape."""
    headers = {protocol.WARNING_HEADER: warning} if warning is not None else {}
    if warning is not None:
        log.warning(f"{request.url.path}: {warning}")
    try:
        stream.scheduler.submit(job)
    except TinyLMError as e:
        if stream.scheduler.closing:
            raise APIError(503, str(e), code="server_shutting_down") from None
        raise APIError(400, str(e)) from None
    if streaming:
        return StreamingResponse(_sse_events(stream, job, result, include_usage), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers})
    collecting = asyncio.ensure_future(_collect(stream, result))
    gone = asyncio.ensure_future(_client_gone(request))
    try:
        await asyncio.wait({collecting, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        left = not collecting.done()
        if left:  # the client left (or this handler was cancelled): free its rows for the others
            stream.scheduler.cancel(job)
            collecting.cancel()
    if left:
        # a cancelled task is only cancelled once it has run again: wait for that (its CancelledError stays in it)
        await asyncio.wait({collecting})
        return Response(status_code=499)  # nobody is listening; the status only shows in the access log
    collecting.result()  # raises the job's error, if any
    return _JSON(result.response(), headers=headers)


async def _collect(stream: _JobStream, result: _Result) -> None:
    async for event in stream.events():
        result.add(event)


async def _client_gone(request: Request) -> None:
    """Returns when the client disconnects (the body is already read, so the next message is the disconnect)."""
    try:
        while (await request.receive())["type"] != "http.disconnect":
            pass
    except Exception:  # the connection broke while waiting: nobody is listening either
        return


def _sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else protocol.json_text(data)}\n\n"


async def _sse_events(stream: _JobStream, job: Job, result: _Result, include_usage: bool) -> AsyncIterator[str]:
    """The stream: chunks as text becomes certain, then the usage chunk (if asked) and ``[DONE]``.

    Leaving this generator early (the client disconnected, so the server cancels it) cancels
    the job: its rows leave the batch at the next step. A bug here, once the 200 is out, ends the
    stream as a failed job's error does: the error as a chunk, then ``[DONE]`` (`_CrashGuard` could
    only cut the connection).
    """
    usage_field: dict[str, Any] = {"usage": None} if include_usage else {}
    try:
        for chunk in result.start_chunks():
            yield _sse({**chunk, **usage_field})
        async for event in stream.events():
            choice = result.add(event)
            if choice is None:
                continue
            body = result.chunk_choice(event.index, choice)
            if body is not None:
                yield _sse({**result.envelope(result.chunk_kind, [body]), **usage_field})
        if include_usage:
            yield _sse({**result.envelope(result.chunk_kind, []), "usage": result.usage()})
    except APIError as e:
        yield _sse(e.body())
    except BaseException as e:
        if not is_crash(e):  # the client left, or the server is stopping: nobody to tell
            raise
        log.error("Exception in a stream", exc_info=e)
        yield _sse(_internal_error(e).body())
    finally:
        stream.scheduler.cancel(job)  # nothing to do if it finished
    yield _sse("[DONE]")



# ----- errors and the API key ----------------------------------------------------------------------


class _JSON(JSONResponse):
    """A JSON response written by `protocol.json_text`: ASCII, so that no text in it can fail to encode."""

    def render(self, content: Any) -> bytes:
        return protocol.json_text(content).encode("ascii")


def _error_response(error: APIError, headers: dict[str, str] | None = None) -> JSONResponse:
    if error.status == 401:
        headers = {**(headers or {}), "WWW-Authenticate": "Bearer"}
    return _JSON(error.body(), status_code=error.status, headers=headers)


def _internal_error(exc: BaseException) -> APIError:
    """A bug's answer: still OpenAI-shaped, a 500 (`openai.InternalServerError`) that says what broke."""
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}")


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(LimitExceeded)
    async def over_limit(request: Request, exc: LimitExceeded) -> JSONResponse:
        return _error_response(exc.api_error(), exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = protocol.validation_message(exc.errors())
        if param is None and not (await request.body()).strip():  # nothing but whitespace is no JSON either
            message = protocol.EMPTY_BODY
        content_type = request.headers.get("content-type")
        if param is None and not protocol.is_json_type(content_type or ""):
            # FastAPI reads a body as JSON only when its Content-Type says so; curl -d sends a form's type
            given = f"is {content_type!r}" if content_type else "is missing"
            message = (f"the body must be JSON sent with 'Content-Type: application/json'; this request's "
                       f"Content-Type {given}")
        return _error_response(APIError(400, message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        messages = {404: f"no such endpoint: {request.method} {request.url.path}",
                    405: f"{request.method} is not allowed on {request.url.path}"}
        if exc.status_code == 400 and exc.__cause__ is not None:  # FastAPI's "There was an error parsing the body"
            messages[400] = protocol.unreadable_body(exc.__cause__)
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        response = _error_response(APIError(exc.status_code, messages.get(exc.status_code, str(exc.detail)),
                                            code=code))
        response.headers.update(exc.headers or {})  # a 405 says which methods are allowed (Allow), as HTTP asks
        return response


class _CrashGuard:
    """ASGI middleware: an exception escaping the app (a bug) is answered 500 in OpenAI's error JSON, and the
    connection stays open for the client's next request.

    Not an ``exception_handler(Exception)``: Starlette runs that one from its outermost layer, which answers
    and then raises the exception again, for the server to log; uvicorn, seeing an exception after the answer
    started, closes the connection, so a keep-alive client's next request on it is reset. Here the traceback
    is logged and the exception ends with the answer. A BaseException that is a failure all the same (a Rust
    tokenizer's panic, see `is_crash`) is answered alike. An exception after part of an answer went out goes
    on up (uvicorn closes the connection: a half-sent answer cannot be finished); after a whole answer, it is
    only logged.
    """

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = finished = False

        async def watched(message: dict) -> None:
            nonlocal started, finished
            started = started or message["type"] == "http.response.start"
            finished = finished or (message["type"] == "http.response.body" and not message.get("more_body"))
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except BaseException as e:
            if not is_crash(e) or (started and not finished):
                raise
            log.error("Exception in ASGI application", exc_info=e)
            if not started:
                await _error_response(_internal_error(e))(scope, receive, send)


class _APIKeyGate:
    """ASGI middleware: without ``Authorization: Bearer <key>`` the API answers 401 (the page and /health stay open)."""

    def __init__(self, app: Any, key: str) -> None:
        self.app = app
        self.expected = key.encode()

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and not (path in OPEN_PATHS or path.startswith(OPEN_PREFIXES)):
            given = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, credentials = given.partition(b" ")
            # the scheme's name is case-insensitive (RFC 7235): "bearer KEY" is as good as "Bearer KEY"
            if not (scheme.lower() == b"bearer" and hmac.compare_digest(credentials.lstrip(b" "), self.expected)):
                message = ("Incorrect API key provided" if given else
                           "You didn't provide an API key: send it as 'Authorization: Bearer KEY'")
                error = APIError(401, message, code="invalid_api_key")
                return await _error_response(error)(scope, receive, send)
        await self.app(scope, receive, send)
