"""What one request may cost the server, so that no client holds it up for the others.

- **The body**: at most ``max_body_bytes`` (`MAX_BODY_BYTES`, 1 MiB, by default), refused with 413 by its
  Content-Length or as soon as more arrives; and it must arrive in full within ``body_timeout`` seconds of
  the request's start (`BODY_TIMEOUT`, 30 s, by default: a 1 MiB body at 35 kB/s). A client that sends less
  than its Content-Length, or stalls midway, gets 408 and its connection is closed, rather than holding
  the connection, and the handler waiting on it, for ever. `BodyGuard` is the ASGI middleware for both.
- **Heavy replies** (the playground's inside view, /tokenize, /detokenize): built and written out as JSON
  in one worker thread beside the event loop (`HeavyLane`), the JSON a slice at a time (`json_bytes`).
  Built on the event loop, a reply of tens of megabytes stopped every other request for seconds: /health,
  and the tokens of the streams in flight. Their inputs are bounded too: the body limit, and the inside
  view's `MAX_EXPLAIN_CHARS` and `MAX_ATTENTION_WEIGHTS`, which keep its replies to a few megabytes.

Each refusal is OpenAI's error JSON (the app's handler for `LimitExceeded`), one line saying the limit
and what to do instead.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

import tinylm.serve.protocol as protocol
from tinylm.serve.options import BODY_TIMEOUT, MAX_BODY_BYTES  # the defaults, checked with the other options
from tinylm.serve.protocol import APIError

T = TypeVar("T")

# a text's pieces are at most its UTF-8 bytes (4 a character) and each is ~60 bytes of JSON at worst, so this
# bounds /explain/tokens' reply near 4 MB (16 Ki characters of English is ~4,000 tokens, past most contexts)
MAX_EXPLAIN_CHARS = 16 * 1024
# one 1024 x 1024 map, ~20 bytes of JSON a weight: the page's one head over a whole 1024-token context
MAX_ATTENTION_WEIGHTS = 1 << 20


class LimitExceeded(StarletteHTTPException):
    """A request over one of the limits: answered ``status`` with ``message`` and the error ``code``.

    An HTTP exception, so that FastAPI passes it on when it is raised while reading the body (any other
    exception there becomes its "There was an error parsing the body").
    """

    def __init__(self, status: int, message: str, code: str, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(status, message, headers)
        self.code = code
        self.param = param

    def api_error(self) -> APIError:
        return APIError(self.status_code, self.detail, param=self.param, code=self.code)


def body_too_large(limit: int) -> LimitExceeded:
    return LimitExceeded(413, f"the request body is larger than {limit} bytes, the most this server reads: send "
                         "a shorter prompt or text", code="request_too_large")


def body_too_slow(timeout: float, received: int, expected: bytes | None) -> LimitExceeded:
    promised = f" of the {expected.decode('latin-1')} its Content-Length promised" if expected else ""
    # the rest of the body may still come: this connection can carry no other request, so it is closed
    return LimitExceeded(408, f"the request body did not arrive in full within {timeout:g} s (got {received} "
                         f"bytes{promised}); send the whole body promptly, or raise the server's --body-timeout",
                         code="request_timeout", headers={"Connection": "close"})


def check_text(text: str, limit: int, path: str) -> None:
    if len(text) > limit:
        raise LimitExceeded(413, f"the text is {len(text)} characters; {path} reads at most {limit}: send a "
                            "shorter text (split a long one into parts)", code="text_too_long", param="text")


class BodyGuard:
    """ASGI middleware: a body over ``max_bytes`` gets 413 (by Content-Length, or while it is read), one not in
    full within ``timeout`` seconds of the request's start gets 408.

    The deadline applies to the body only: once its last part is in, the app's later ``receive`` calls (a
    handler waiting for the client to disconnect, as a stream does) wait as long as the answer takes.
    """

    def __init__(self, app: Any, max_bytes: int = MAX_BODY_BYTES, timeout: float = BODY_TIMEOUT) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout = timeout

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            error = body_too_large(self.max_bytes)
            return await _answer(error, scope, receive, send)
        deadline = asyncio.get_running_loop().time() + self.timeout
        received = 0
        complete = False

        async def guarded() -> dict:
            nonlocal received, complete
            if complete:
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                raise body_too_slow(self.timeout, received, length) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise body_too_large(self.max_bytes)
                complete = not message.get("more_body", False)
            else:  # the client disconnected
                complete = True
            return message

        await self.app(scope, guarded, send)


async def _answer(error: LimitExceeded, scope: dict, receive: Callable, send: Callable) -> None:
    body = protocol.json_text(error.api_error().body())
    await Response(body, status_code=error.status_code, media_type="application/json",
                   headers=error.headers)(scope, receive, send)


class HeavyLane:
    """The worker thread where the heavy requests' work and replies are made, one request at a time.

    A thread keeps the work off the event loop, but not off the GIL: Python code in a worker hands the GIL
    back to the loop only every few milliseconds (`sys.getswitchinterval`), so each more busy worker
    stretches every step the loop takes. Four 0.9 MB texts to /tokenize in four threads held /health for up
    to 0.8 s and a stream's tokens for up to 3 s; in one lane, 0.3 s. The heavy requests wait for each other
    instead of the light ones waiting for them.
    """

    def __init__(self) -> None:
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tinylm-heavy")

    async def run(self, work: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.pool, functools.partial(work, *args))

    async def reply(self, build: Callable[[], Any]) -> Response:
        """``build()``'s reply, written as JSON (`json_bytes`), both in the lane."""
        body = await self.run(lambda: json_bytes(build()))
        return Response(body, media_type="application/json")

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


JSON_SLICE = 512  # list items written by one call of the JSON encoder: tens of kB, about a millisecond


def json_bytes(data: Any) -> bytes:
    """``protocol.json_text(data)`` as ASCII bytes, written a slice of a long list at a time.

    The JSON encoder holds the GIL for all of one call: on a reply of megabytes that is a tenth of a second
    and more during which the event loop cannot run. Slices let it in between (nested lists, an attention
    map's rows, one at a time).
    """
    parts: list[str] = []
    _write(data, parts)
    return "".join(parts).encode("ascii")


def _write(data: Any, parts: list[str]) -> None:
    if isinstance(data, dict):
        parts.append("{")
        for k, (key, value) in enumerate(data.items()):
            parts.append(("," if k else "") + protocol.json_text(str(key)) + ":")
            _write(value, parts)
        parts.append("}")
    elif isinstance(data, list) and data and isinstance(data[0], list):
        parts.append("[")
        for k, item in enumerate(data):
            if k:
                parts.append(",")
            _write(item, parts)
        parts.append("]")
    elif isinstance(data, list) and len(data) > JSON_SLICE:
        slices = (protocol.json_text(data[i:i + JSON_SLICE])[1:-1] for i in range(0, len(data), JSON_SLICE))
        parts.append("[" + ",".join(slices) + "]")
    else:
        parts.append(protocol.json_text(data))
