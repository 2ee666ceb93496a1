"""The app's answers to what goes wrong, and its ASGI middleware (the body limits are `tinylm.serve.limits`).

- `JSON`: every JSON reply, written in ASCII by `protocol.json_text`.
- `add_error_handlers`: a request FastAPI or a route refuses becomes OpenAI's error JSON with its 4xx status.
- `CrashGuard`: a bug becomes a 500 in the same JSON, and the client's connection stays open.
- `APIKeyGate`: with an API key, the API answers 401 to a request without it (`OPEN_PATHS` stay open).
- `add_middleware`: the stack in the order it must run, CORS outermost.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Callable, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

import tinylm.serve.protocol as protocol
from tinylm.serve.jobs import is_crash
from tinylm.serve.limits import BodyGuard, LimitExceeded
from tinylm.serve.protocol import APIError

# no API key needed: the page, its files, liveness (not the docs: they and /openapi.json lay the API out, so a
# key guards them as it guards the API)
OPEN_PATHS = {"/", "/health"}
OPEN_PREFIXES = ("/static/",)
log = logging.getLogger("uvicorn.error")  # where uvicorn logs the errors of the apps it serves


def add_middleware(app: FastAPI, *, api_key: str | None, allow_origins: Sequence[str], max_body_bytes: int,
                   body_timeout: float) -> None:
    """The middleware stack; each one added wraps those before it, so the last added runs first."""
    app.add_middleware(BodyGuard, max_bytes=max_body_bytes, timeout=body_timeout)
    if api_key:
        app.add_middleware(APIKeyGate, key=api_key)
    app.add_middleware(CrashGuard)  # inside CORS, so that a browser's page can read a 500 too
    if allow_origins:  # added last, so it runs first: a browser's preflight carries no API key
        app.add_middleware(CORSMiddleware, allow_origins=list(allow_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"], expose_headers=[protocol.WARNING_HEADER])


class JSON(JSONResponse):
    """A JSON response written by `protocol.json_text`: ASCII, so that no text in it can fail to encode."""

    def render(self, content: Any) -> bytes:
        return protocol.json_text(content).encode("ascii")


def error_response(error: APIError, headers: dict[str, str] | None = None) -> JSONResponse:
    if error.status == 401:
        headers = {**(headers or {}), "WWW-Authenticate": "Bearer"}
    return JSON(error.body(), status_code=error.status, headers=headers)


def internal_error(exc: BaseException) -> APIError:
    """A bug's answer: still OpenAI-shaped, a 500 (`openai.InternalServerError`) that says what broke."""
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}")


def add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(LimitExceeded)
    async def over_limit(request: Request, exc: LimitExceeded) -> JSONResponse:
        return error_response(exc.api_error(), exc.headers)

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
        return error_response(APIError(400, message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        messages = {404: f"no such endpoint: {request.method} {request.url.path}",
                    405: f"{request.method} is not allowed on {request.url.path}"}
        if exc.status_code == 400 and exc.__cause__ is not None:  # FastAPI's "There was an error parsing the body"
            messages[400] = protocol.unreadable_body(exc.__cause__)
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        response = error_response(APIError(exc.status_code, messages.get(exc.status_code, str(exc.detail)),
                                            code=code))
        response.headers.update(exc.headers or {})  # a 405 says which methods are allowed (Allow), as HTTP asks
        return response


class CrashGuard:
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
                await error_response(internal_error(e))(scope, receive, send)


class APIKeyGate:
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
                return await error_response(error)(scope, receive, send)
        await self.app(scope, receive, send)
