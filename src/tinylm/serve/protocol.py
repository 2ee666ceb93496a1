"""The OpenAI wire format: request schemas, their checks, errors, and the JSON of responses and stream chunks.

Requests are validated in pydantic's strict mode, as the OpenAI API does: ``"max_tokens": "10"``
or ``"n": true`` is a type error, not a quiet conversion. Fields that are part of the OpenAI API
but that tinylm does not implement (penalties, ``logit_bias``, tools, ...) are accepted at their
neutral values (0, a ``logit_bias`` of zeros) and refused otherwise, so a client never gets
silently different behaviour. Unknown fields are ignored, as many clients send a few extras.

Errors are the OpenAI shape, ``{"error": {"message", "type", "param", "code"}}``, with the
status codes the official clients map to their exception classes (400 `BadRequestError`,
401 `AuthenticationError`, 404 `NotFoundError`, 413, 500 `InternalServerError`).

The extensions beyond the OpenAI API: ``top_k`` and ``min_p`` on both completion endpoints
(as vLLM accepts them), and ``logprobs`` up to 20 on `/v1/completions` (OpenAI stops at 5).

The sampling ranges are OpenAI's, narrowed where a value would only be rounding noise:
``temperature`` is 0 (greedy decoding) or from `MIN_TEMPERATURE` (0.001) to 2; below 0.001
sampling is greedy in all but name, and dividing logits by a vanishing temperature overflows
float32. ``top_p`` is from `MIN_TOP_P` (0.001) to 1; a smaller one keeps the most likely token
alone (temperature 0 says that). ``stream_options`` is allowed only with ``stream: true``, as
OpenAI answers.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

from tinylm.errors import TinyLMError
from tinylm.generate.sampling import SamplingParams
from tinylm.generate.steps import fit_prompt
from tinylm.serve.chat import ChatFormat
from tinylm.serve.jobs import TokenLogprob
from tinylm.tokenizers.base import Tokenizer

MAX_CHOICES = 128  # prompts x n in one request
MAX_STOP = 16
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # the OpenAI default for /v1/completions
MAX_TEMPERATURE = 2.0  # OpenAI's range is 0..2
MIN_TEMPERATURE = 1e-3  # besides 0 (greedy): a smaller one is greedy decoding with float32 overflow
MIN_TOP_P = 1e-3  # a smaller top_p keeps the most likely token alone


class APIError(Exception):
    """An error answered as OpenAI error JSON with ``status``; ``param`` names the offending field."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# ----- requests ----------------------------------------------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool | None = None


class _Sampling(_Strict):
    """The settings both completion endpoints share. None everywhere means "the default"."""

    model: str | None = None
    temperature: float | None = Field(None, ge=0, le=MAX_TEMPERATURE, allow_inf_nan=False)
    top_p: float | None = Field(None, ge=MIN_TOP_P, le=1, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=-1)  # extension; 0 and -1 (vLLM's spelling) mean off
    min_p: float | None = Field(None, ge=0, le=1, allow_inf_nan=False)  # extension
    n: int | None = Field(None, ge=1, le=MAX_CHOICES)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, lt=2**63)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    # in the OpenAI API, not implemented here: accepted at their neutral values only
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    @field_validator("temperature")
    @classmethod
    def _temperature_not_vanishing(cls, value: float | None) -> float | None:
        if value is not None and 0 < value < MIN_TEMPERATURE:
            raise PydanticCustomError("temperature_range", "must be 0 (greedy decoding) or at least {minimum}",
                                      {"minimum": MIN_TEMPERATURE})
        return value

    def check_unsupported(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
                           param="stream_options")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0):
                raise APIError(400, f"{name} is not supported by tinylm; leave it out or set it to 0", param=name)
        if self.logit_bias and any(bias != 0 for bias in self.logit_bias.values()):  # all zeros: no bias
            raise APIError(400, "logit_bias is not supported by tinylm; leave it out", param="logit_bias")

    def stop_strings(self) -> tuple[str, ...]:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if len(stop) > MAX_STOP or any(s == "" for s in stop):
            raise APIError(400, f"stop takes up to {MAX_STOP} non-empty strings", param="stop")
        return stop

    def sampling_params(self, max_tokens: int, extra_stop: Sequence[str] = ()) -> SamplingParams:
        try:
            return SamplingParams(
                max_new_tokens=max_tokens,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_k=None if self.top_k in (None, -1) else self.top_k,
                top_p=self.top_p,
                min_p=self.min_p,
                seed=self.seed,
                num_samples=self.n or 1,
                stop=tuple(extra_stop) + self.stop_strings(),
            )
        except TinyLMError as e:  # the ranges above make this rare; the library's own check has the last word
            raise APIError(400, str(e)) from None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: a prompt (text, texts, token ids, or lists of token ids) to continue."""

    prompt: str | list[str] | list[int] | list[list[int]] = ""
    max_tokens: int | None = Field(None, ge=0)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.best_of not in (None, self.n or 1):
            raise APIError(400, "best_of is not supported by tinylm; leave it out or set it to n", param="best_of")
        if self.suffix:
            raise APIError(400, "suffix (insertion) is not supported by tinylm; leave it out", param="suffix")

    def prompt_ids(self, tokenizer: Tokenizer) -> list[list[int]]:
        """Each prompt's token ids (without the start ids); text is encoded, ids are checked."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [tokenizer.encode(prompt)]
        if not prompt:
            raise APIError(400, "prompt is an empty list: give a string, a list of strings or token ids",
                           param="prompt")
        if isinstance(prompt[0], str):
            return [tokenizer.encode(p) for p in prompt]
        lists = [prompt] if isinstance(prompt[0], int) else prompt
        for ids in lists:
            if any(not 0 <= i < tokenizer.vocab_size for i in ids):
                raise APIError(400, f"prompt holds token ids outside the vocabulary 0..{tokenizer.vocab_size - 1}",
                               param="prompt")
        return [list(ids) for ids in lists]


class ContentPart(_Strict):
    type: str
    text: str | None = None


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatRequest(_Sampling):
    """``POST /v1/chat/completions``: messages, written out with the model's chat template or the transcript
    (`tinylm.serve.chat`)."""

    messages: list[ChatMessage]
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # the newer name of max_tokens
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.tools:
            raise APIError(400, "tools are not supported by tinylm's base models; leave them out", param="tools")
        if self.tool_choice not in (None, "none", "auto"):
            raise APIError(400, "tool_choice is not supported by tinylm; leave it out", param="tool_choice")
        if self.response_format not in (None, {"type": "text"}):
            raise APIError(400, "only response_format {'type': 'text'} is supported", param="response_format")
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")

    def prompt_ids(self, chat: ChatFormat) -> list[int]:
        """The messages' prompt (`ChatFormat.prompt_ids`); a message or template that refuses them is a 400."""
        messages = [{"role": m.role, "content": None if m.content is None else
                     (m.content if isinstance(m.content, str) else [p.model_dump() for p in m.content]),
                     "name": m.name} for m in self.messages]
        try:
            return chat.prompt_ids(messages)
        except TinyLMError as e:
            raise APIError(400, str(e), param="messages") from None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def chat_sampling_params(self, max_tokens: int, chat: ChatFormat) -> SamplingParams:
        return self.sampling_params(max_tokens, extra_stop=chat.stop)


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True  # the start ids a prompt is generated after (a chat template writes its own)


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


class NextTokenRequest(_Strict):
    """``POST /next_token`` (the playground's): the distribution of the token after ``prompt``."""

    model: str | None = None
    prompt: str = ""
    top: int = Field(20, ge=1, le=200)


class ExplainTokensRequest(_Strict):
    """``POST /explain/tokens`` (the playground's inside view): how ``text`` splits into tokens."""

    model: str | None = None
    text: str


class ExplainAttentionRequest(ExplainTokensRequest):
    """``POST /explain/attention``: the attention weights over ``text``'s tokens; every layer and head by default,
    or one layer's heads, or one head of one layer."""

    layer: int | None = Field(None, ge=0)
    head: int | None = Field(None, ge=0)


# fields that take several shapes: a type error there lists every shape's failure; one line says them all
UNION_FIELDS = {"prompt": "a string, a list of strings, a list of token ids or a list of lists of token ids",
                "stop": "a string or a list of strings", "content": "a string or a list of text parts"}


EMPTY_BODY = "the body is empty: send the request as a JSON object"


def validation_message(errors: Sequence[dict[str, Any]]) -> tuple[str, str | None]:
    """One readable line and the offending parameter from pydantic's errors (the first one counts)."""
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return f"the body is not valid JSON ({detail})" if detail else "the body is not valid JSON", None
    # pydantic names a failed union member after the field ("prompt.str", "prompt.list[int].0"): drop those
    # (a part may be a dict key as sent, "" included)
    parts = [p for p in loc if not (p[:1].isalpha() and ("[" in p or p in {"str", "int", "float", "bool"}))]
    param = parts[0] if parts else None
    where = "".join(f"[{p}]" if p.isdigit() else f".{p}" for p in parts[1:])
    if param is None and first.get("type") == "missing":
        return EMPTY_BODY, None
    if param is None:
        return f"the body must be a JSON object: {first.get('msg', 'invalid')}", None
    if first.get("type") == "missing":
        return f"{param}{where} is required", param
    field = parts[-1] if parts[-1] in UNION_FIELDS else param
    if len(errors) > 1 and field in UNION_FIELDS:  # every member of the union failed: say what would do
        return f"{param}{where} must be {UNION_FIELDS[field]}", param
    return f"{param}{where}: {first.get('msg', 'invalid')}", param


def unreadable_body(cause: BaseException) -> str:
    """One line for a body that could not be parsed at all (FastAPI's "There was an error parsing the body"),
    from the exception that stopped the parser."""
    if isinstance(cause, UnicodeDecodeError):
        return (f"the body is not JSON text: its bytes do not decode as {cause.encoding.upper()} ({cause.reason} "
                f"at byte {cause.start}); send the JSON encoded as UTF-8")
    if isinstance(cause, RecursionError):
        return "the body's JSON nests arrays or objects too deeply to read; send a flatter body"
    return f"the body could not be read as JSON ({type(cause).__name__}); send a JSON object encoded as UTF-8"


def is_json_type(content_type: str) -> bool:
    """Whether a Content-Type header says JSON (``application/json``, ``application/*+json``), as FastAPI reads it."""
    kind = content_type.split(";", 1)[0].strip().lower()
    return kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))


WARNING_HEADER = "X-TinyLM-Warning"  # what a completion's response says of a prompt it had to cut


def fit_context(prompts: Sequence[Sequence[int]], max_tokens: int, block_size: int, what: str = "prompt",
                echo: bool = False) -> tuple[list[list[int]], str | None]:
    """Each prompt as the model reads it beside ``max_tokens`` new tokens (`tinylm.generate.steps.fit_prompt`:
    its most recent tokens, the start dropped), and the warning line (None when every prompt fits whole).

    The batches never slide the model's window, so a prompt keeps at most ``block_size - max_tokens`` tokens.
    Refused (400 context_length_exceeded): a ``max_tokens`` that leaves no room for any prompt, and ``echo``
    of a prompt that does not fit (the reply could not carry the part the model never read).
    """
    kept, warnings = [], []
    for ids in prompts:
        try:
            fitted, warning = fit_prompt(ids, block_size, room=max_tokens)
        except TinyLMError as e:
            raise APIError(400, str(e), param="max_tokens", code="context_length_exceeded") from None
        if warning is not None and echo:
            raise APIError(400, f"{warning}; echo returns the whole prompt, so send a shorter one or leave echo out",
                           param=what, code="context_length_exceeded")
        kept.append(fitted)
        if warning is not None and warning not in warnings:
            warnings.append(warning)
    return kept, "; ".join(warnings) or None


# ----- responses ---------------------------------------------------------------------------------------


def json_text(data: Any) -> str:
    """The JSON of a response body or a stream chunk, in ASCII: every character past ASCII as a ``\\u`` escape.

    So no text can fail to encode: a lone surrogate (``"\\ud800"`` is valid JSON, but no UTF-8 can hold it)
    that a request sent comes back as the escape it arrived as, in an error message that quotes it; and no
    character (U+2028, U+0085) can split a stream's line for clients that split lines by Unicode's rules.
    """
    return json.dumps(data, ensure_ascii=True, allow_nan=False, separators=(",", ":"))


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def token_string(tokenizer: Tokenizer, token_id: int) -> str:
    """A token's text for logprobs; bytes that are only part of a character are written ``bytes:\\xe2\\x80``."""
    data = tokenizer.token_bytes(token_id)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in data)


def finite(logprob: float | None) -> float | None:
    """A log-probability JSON can carry: -inf (a token an n-gram never saw) becomes -9999.0, as OpenAI writes it."""
    return logprob if logprob is None or math.isfinite(logprob) else -9999.0


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_logprobs(tokenizer: Tokenizer, tokens: Sequence[TokenLogprob], offset: int = 0) -> dict[str, list]:
    """The legacy completions format: parallel lists of tokens, their logprobs, alternatives and text offsets.

    Each ``top_logprobs`` entry maps the most likely tokens *and* the chosen one to their
    log-probabilities (so it may hold one more than asked, as OpenAI's does).
    """
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for t in tokens:
        out["tokens"].append(token_string(tokenizer, t.id))
        out["token_logprobs"].append(finite(t.logprob))
        top = {token_string(tokenizer, i): finite(lp) for i, lp in t.top}
        if t.logprob is not None:
            top.setdefault(token_string(tokenizer, t.id), finite(t.logprob))
        out["top_logprobs"].append(top if t.logprob is not None else None)
        out["text_offset"].append(offset + t.offset)
    return out


def chat_logprobs(tokenizer: Tokenizer, tokens: Sequence[TokenLogprob]) -> dict[str, list]:
    """The chat format: one entry per token with its bytes and its ``top_logprobs`` alternatives."""

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        return {"token": token_string(tokenizer, token_id), "logprob": finite(logprob),
                "bytes": list(tokenizer.token_bytes(token_id))}

    return {"content": [{**entry(t.id, t.logprob), "top_logprobs": [entry(i, lp) for i, lp in t.top]}
                        for t in tokens]}

