"""From scheduler events to OpenAI responses: one JSON body, or a stream of server-sent events.

A route builds a `Job` and the `Result` of its endpoint (`Completions`, `ChatCompletions`), then hands both to
`respond`, which submits the job and answers. The job's events cross from the scheduler's thread to the
request's event loop through a `JobStream`; the `Result` gathers them into choices and writes the body, or a
chunk per piece of text as it becomes certain. A client that leaves cancels its job either way.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

import tinylm.serve.protocol as protocol
from tinylm.errors import TinyLMError
from tinylm.serve.chat import is_blank_token, reply_text
from tinylm.serve.jobs import ChoiceEvent, Job, JobDone, JobFailed, PromptEvent, TokenLogprob, is_crash
from tinylm.serve.middleware import JSON, internal_error
from tinylm.serve.protocol import APIError
from tinylm.serve.scheduler import Scheduler
from tinylm.serve.served import ServedModel

log = logging.getLogger("uvicorn.error")  # where uvicorn logs the errors of the apps it serves


class JobStream:
    """A job's events, handed from the scheduler's thread to this request's event loop.

    ``whole``: the answer is one body, not a stream, so nothing reads the events before the job ends; they
    wait on the scheduler's thread and cross in one hand-over. Waking the event loop once per request
    instead of once per decoding step leaves the scheduler's thread (and the interpreter's lock) to decoding.
    """

    def __init__(self, scheduler: Scheduler, whole: bool = False) -> None:
        self.scheduler = scheduler
        self.whole = whole
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[list] = asyncio.Queue()
        self.held: list = []  # a whole answer's events so far (the scheduler's thread alone touches it)

    def push(self, events: list) -> None:  # called on the scheduler's thread
        if self.whole and not any(isinstance(e, (JobDone, JobFailed)) for e in events):
            self.held.extend(events)
            return
        events, self.held = self.held + events, []
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
    visible: bool = False  # chat: a token with a visible character was generated (see `ChatCompletions.shows`)


class Result:
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


class Completions(Result):
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


class ChatCompletions(Result):
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


async def respond(request: Request, stream: JobStream, job: Job, result: Result, streaming: bool | None,
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
    return JSON(result.response(), headers=headers)


async def _collect(stream: JobStream, result: Result) -> None:
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


async def _sse_events(stream: JobStream, job: Job, result: Result, include_usage: bool) -> AsyncIterator[str]:
    """The stream: chunks as text becomes certain, then the usage chunk (if asked) and ``[DONE]``.

    Leaving this generator early (the client disconnected, so the server cancels it) cancels
    the job: its rows leave the batch at the next step. A bug here, once the 200 is out, ends the
    stream as a failed job's error does: the error as a chunk, then ``[DONE]`` (`CrashGuard` could
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
        yield _sse(internal_error(e).body())
    finally:
        stream.scheduler.cancel(job)  # nothing to do if it finished
    yield _sse("[DONE]")
