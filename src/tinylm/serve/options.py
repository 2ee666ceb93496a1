"""The serving options every way in checks alike: `tinylm serve`'s flags, `serve(...)` and `create_app(...)`.

The policy is here, not in the command: where the API key comes from (``api_key``, else
``$TINYLM_API_KEY``; unset or empty: no key), and which values are refused. An empty key is refused rather
than read as "no key", since it would silently switch off a key set in the environment; so is a
``$TINYLM_API_KEY`` of spaces alone (a key no client could send), an empty model name, a body timeout that
is no number of seconds, and an allowed origin with a path (a browser sends its origin without one, so it
would never match). Each refusal is one line that names the flag and the Python argument both.

Plain Python, no FastAPI: the command checks its flags with it before anything is loaded.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping, Sequence

from tinylm.errors import TinyLMError

API_KEY_ENV = "TINYLM_API_KEY"
MAX_BODY_BYTES = 1 << 20  # 1 MiB: far more than any prompt a tinylm model's context can hold
BODY_TIMEOUT = 30.0  # seconds for a whole body to arrive
ORIGIN = re.compile(r"[a-zA-Z][a-zA-Z0-9+.-]*://[^/\s]+")  # scheme://host[:port], as a browser's Origin header


def api_key_or_env(api_key: str | None, environ: Mapping[str, str] | None = None) -> str | None:
    """The key clients must send: ``api_key`` when given, else ``$TINYLM_API_KEY`` (unset or empty: None)."""
    if api_key is not None:
        check_options(api_key=api_key)
        return api_key
    env_key = (os.environ if environ is None else environ).get(API_KEY_ENV)
    if env_key and not env_key.strip():
        raise TinyLMError(f"${API_KEY_ENV} holds only spaces: set it to the key clients must send, or unset it "
                          f"(or set it empty) to serve without a key")
    return env_key or None


def check_options(*, api_key: str | None = None, model_name: str | None = None, body_timeout: float | None = None,
                  allow_origins: Sequence[str] = ()) -> None:
    """Refuse, in one line, a serving option that cannot be meant (None: the option's default, always fine)."""
    if api_key is not None and not api_key.strip():
        raise TinyLMError(f"--api-key is empty (api_key={api_key!r}): give the key clients must send, or leave it "
                          f"out for none (then `tinylm serve` and serve() read ${API_KEY_ENV} if set)")
    if model_name is not None and not model_name.strip():
        raise TinyLMError(f"--model-name is empty (model_name={model_name!r}): give the id clients ask for, or "
                          "leave it out (then the run folder's name is used)")
    if body_timeout is not None and not 0 < body_timeout < math.inf:
        raise TinyLMError(f"--body-timeout is {body_timeout} (body_timeout): give the seconds a request's body may "
                          f"take to arrive, a number above 0 (default: {BODY_TIMEOUT:g})")
    if isinstance(allow_origins, str):  # one origin given bare would be checked a character at a time
        raise TinyLMError(f"allow_origins is the string {allow_origins!r}: give a list of origins, e.g. "
                          f"[{allow_origins!r}]")
    for origin in allow_origins:
        if origin != "*" and not ORIGIN.fullmatch(origin):
            raise TinyLMError(f"--allow-origin {origin!r} is not an origin (allow_origins): give scheme://host[:port] "
                              "with no path (e.g. http://localhost:3000), or * for any")
