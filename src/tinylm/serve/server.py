"""Running the app: `serve` loads a run and serves it with uvicorn (what `tinylm serve` calls).

The listening socket is bound here, before uvicorn starts, so that a port already in use or a
host that cannot be listened on is one clear `TinyLMError` (the CLI prints one line and exits
with status 2) rather than a log message from inside the server. The default host is the
loopback address: the server is reachable from this machine only unless ``--host 0.0.0.0``
says otherwise (and then ``--api-key`` is worth setting).

The API key comes from ``api_key`` (``--api-key``), else from ``$TINYLM_API_KEY`` (unset or empty:
no key); the options are checked before the socket is bound or the run loaded, by the same rules
`create_app` and the command apply (`tinylm.serve.options`).

**Shutting down** (Ctrl+C, SIGTERM): the server stops taking connections and lets the requests
in flight finish for up to ``graceful_timeout`` seconds (uvicorn's graceful shutdown). Shortly
before that time runs out (`graceful_server`), the generations still running are ended
(`Scheduler.end_all`): a client waiting for a whole response gets a 503 "the server is shutting
down" in OpenAI's error JSON, a stream gets that error as a chunk, then ``[DONE]``. Left to
uvicorn, they would be cancelled: a plain-text 500, a stream cut short, tracebacks in the log.
A second Ctrl+C, which uvicorn reads as "force quit", ends the generations at once in the same
way, so the answers still go out and the server stops without waiting out the timeout; a third
forces it.

The socket listens before the model is loaded, so a port in use is reported at once, not after
a long load (clients that connect meanwhile wait until the server runs). Listening on an address other than loopback without an API key prints a warning:
anyone who can reach the machine can then use the model.
"""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import os
import signal
import socket
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tinylm.errors import TinyLMError
from tinylm.serve.options import API_KEY_ENV, api_key_or_env, check_options

__all__ = ["API_KEY_ENV", "bind_socket", "graceful_server", "is_loopback", "serve", "url_for"]
GRACEFUL_TIMEOUT = 5.0  # seconds the requests in flight may run on once the server is asked to stop
BACKLOG = 2048  # connections the kernel queues before the server accepts them (as uvicorn's default)
END_MARGIN = 1.0  # end the generations this long before the graceful timeout, so that their answers go out


def graceful_server(config: Any, end_all: Callable[[], None]) -> Any:
    """A `uvicorn.Server` for ``config`` that calls ``end_all`` (from the event loop) when a shutdown has waited
    ``config.timeout_graceful_shutdown`` less `END_MARGIN` seconds (at most half of it) for the requests in flight.

    Uvicorn would cancel the requests still running at the timeout; ending their generations first lets every
    handler answer (503, or an error chunk) and its connection close before then.
    """
    import uvicorn

    class GracefulServer(uvicorn.Server):
        loop: asyncio.AbstractEventLoop | None = None
        ended_early = False

        async def startup(self, sockets: Any = None) -> None:
            self.loop = asyncio.get_running_loop()
            await super().startup(sockets)

        def handle_exit(self, sig: int, frame: Any) -> None:
            if self.should_exit and sig == signal.SIGINT and not self.ended_early and self.loop is not None:
                # the second Ctrl+C: uvicorn would stop waiting and cancel the requests in flight; end them now
                # (from the event loop, not from inside this signal handler), and leave force quit to a third
                self.ended_early = True
                print("tinylm: ending the generations still running now (their clients get a 503); "
                      "Ctrl+C again to force quit", file=sys.stderr, flush=True)
                self.loop.call_soon_threadsafe(end_all)
                return
            super().handle_exit(sig, frame)

        async def shutdown(self, sockets: Any = None) -> None:
            grace = self.config.timeout_graceful_shutdown
            timer = None
            if grace is not None:
                wait = max(0.0, grace - min(END_MARGIN, grace / 2))
                timer = asyncio.get_running_loop().call_later(wait, end_all)
            try:
                await super().shutdown(sockets)
            finally:
                if timer is not None:
                    timer.cancel()

    return GracefulServer(config)


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: any free port), or a one-line error saying why not.

    It listens at once: with SO_REUSEADDR, two sockets may both bind a port until one listens, so only
    listening proves the port is ours. Clients that connect before the server runs wait in the backlog.
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise TinyLMError(f"cannot listen on host {host!r} ({e.strerror}); use an address such as 127.0.0.1") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    # as uvicorn does: a restarted server may reuse the port while old connections linger in TIME_WAIT
    # (on Linux this never allows two servers listening on one port)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(BACKLOG)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise TinyLMError(f"port {port} on {host} is already in use (another server?); stop it or choose "
                              "another with --port") from None
        if e.errno == errno.EACCES:
            raise TinyLMError(f"no permission to listen on port {port}; ports below 1024 need root: choose "
                              "another with --port") from None
        raise TinyLMError(f"cannot listen on {host}:{port} ({e.strerror})") from None
    return sock


def serve(run_dir: str | os.PathLike | None, *, host: str = "127.0.0.1", port: int = 8000,
          api_key: str | None = None, model_name: str | None = None, max_batch_size: int = 32,
          batch_window: float = 0.002, checkpoint: str = "best", device: str = "cpu", log_level: str = "info",
          graceful_timeout: float = GRACEFUL_TIMEOUT, allow_origins: Sequence[str] = (),
          draft: str | None = None, draft_k: int = 4, body_timeout: float | None = None,
          threads: int | None = None, adapters: Mapping[str, str | os.PathLike] | Sequence[str] = (),
          quant: str | None = None, prefix_cache_mb: float = 256) -> None:
    """Serve the run in ``run_dir`` until interrupted (Ctrl+C): the OpenAI API under /v1, the playground at /.

    ``api_key``: the key clients must send; None reads ``$TINYLM_API_KEY`` (unset or empty: no key).
    ``draft`` ("ngram", "prompt" or a run folder) decodes a lone request by speculative rounds of up to
    ``draft_k`` drafts (`tinylm.serve.scheduler`).

    ``port`` 0 takes any free port (the line printed at start says which). ``graceful_timeout``: how long a
    shutdown waits for the requests in flight (see the module docstring). ``body_timeout``: the seconds a
    request's body may take to arrive (None: `tinylm.serve.limits.BODY_TIMEOUT`). ``threads``: CPU threads for
    the server's life; None follows `tinylm.device.use_threads` (busy cores left out, said in one line).

    ``adapters`` ({name: folder}, or ``NAME=DIR`` strings as ``--adapter`` takes them): LoRA adapters of the
    run's model, each served under its own name beside it (`tinylm.serve.adapters`); ``run_dir`` may then be
    the base's checkpoint folder, or None for the adapters' own base. They are read and checked against the
    base before the socket is bound.

    ``quant`` ("int8"): decode with the model's matrices in int8 (`tinylm.model.quant`); not with adapters,
    which add their corrections to the base's float weights.

    ``prefix_cache_mb``: memory for the keys and values of earlier requests, reused by a request that starts with
    the same tokens (`tinylm.generate.prefix_cache`); 0 turns it off.
    """
    try:
        import uvicorn

        from tinylm.serve.app import create_app
        from tinylm.serve.limits import BODY_TIMEOUT
    except ImportError as e:
        raise TinyLMError(f"tinylm serve needs FastAPI and uvicorn ({e.name} is missing): "
                          "reinstall tinylm (pip install -e .), which brings them") from None
    from tinylm.device import use_threads
    from tinylm.run import load_run
    from tinylm.serve.adapters import checkpoint_run, is_checkpoint_folder

    api_key = api_key_or_env(api_key)
    check_options(model_name=model_name, body_timeout=body_timeout, allow_origins=allow_origins)
    run_dir, model_name, found = check_base_and_adapters(run_dir, checkpoint, model_name, adapters)
    if quant and found:
        raise TinyLMError("--quant int8 serves one model; adapters add to the base's float weights: drop --quant "
                          "or --adapter")
    sock = bind_socket(host, port)  # before loading: a port in use is said at once, not after a long load
    try:
        run = (checkpoint_run(run_dir, device) if is_checkpoint_folder(run_dir)
               else load_run(run_dir, checkpoint=checkpoint, device=device))
        if quant:
            from tinylm.model.quant import check_quantizable, quantize_int8

            check_quantizable(run.model, quant)
            quantize_int8(run.model)
        app = create_app(run, model_name=model_name, api_key=api_key, max_batch_size=max_batch_size,
                         batch_window=batch_window, allow_origins=allow_origins, draft=draft, draft_k=draft_k,
                         body_timeout=BODY_TIMEOUT if body_timeout is None else body_timeout, adapters=found,
                         prefix_cache_mb=prefix_cache_mb)
    except BaseException:
        sock.close()
        raise
    bound_host, bound_port = sock.getsockname()[:2]
    if not is_loopback(bound_host) and not api_key:
        print(f"tinylm: warning: listening on {bound_host}, beyond this machine, with no API key: anyone who can "
              "reach it can use the model; set --api-key (or $TINYLM_API_KEY) to require one", file=sys.stderr,
              flush=True)
    beside = "".join(f"{', ' if i else ' with the adapters '}'{a.name}'" for i, a in enumerate(found))
    print(f"serving {run_dir} as '{app.state.model.name}'{beside} at {url_for(bound_host, bound_port)} "
          f"(OpenAI API under /v1, playground at /; Ctrl+C stops)", flush=True)
    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=graceful_timeout)
    server = graceful_server(config, app.state.scheduler.end_all)
    # the threads for the server's life, chosen once it is loaded (an error before stays one line); the
    # scheduler's thread starts with the server, under this count
    with use_threads(device, threads, log=lambda line: print(f"tinylm: {line}", file=sys.stderr, flush=True)):
        run_server(server, sock)


def check_base_and_adapters(run_dir: str | os.PathLike | None, checkpoint: str, model_name: str | None,
                            adapters: Mapping[str, str | os.PathLike] | Sequence[str]) -> tuple[Path, str | None, list]:
    """Before anything is bound or loaded: the folder to serve (the adapters' base where ``run_dir`` is None),
    the base's name (None: the run folder's, as without adapters) and the adapters, read and checked against
    the base (`tinylm.serve.adapters`)."""
    from tinylm.run import check_run_dir, load_checkpoint
    from tinylm.serve.adapters import (
        adapters_base,
        base_name,
        check_adapters,
        find_adapters,
        is_checkpoint_folder,
        served_checkpoint,
    )

    found = find_adapters(adapters) if adapters else []
    if run_dir is None:
        if not found:
            raise TinyLMError("give the run to serve (--run DIR), or adapters (--adapter NAME=DIR) whose base to serve")
        given, run_dir = None, adapters_base(found)
    else:
        given = run_dir = check_run_dir(run_dir)
    if found:
        base = served_checkpoint(run_dir, checkpoint)
        if base is None:  # an n-gram run, or none trained yet
            raise TinyLMError(f"{run_dir} has no checkpoint of a network for the adapters to adapt; give the run "
                              "they were trained on (or leave out --run)")
        model_name = model_name or base_name(given, base)
        check_adapters(found, load_checkpoint(base), model_name)
    elif is_checkpoint_folder(run_dir):  # a checkpoint folder is named as its run (when it has one)
        model_name = model_name or base_name(given, run_dir)
    return Path(run_dir), model_name, found


def run_server(server: Any, sock: socket.socket) -> None:
    """Serve on ``sock`` until the server stops."""
    server.run(sockets=[sock])


def is_loopback(host: str) -> bool:
    """Whether a bound address is this machine's alone (127.0.0.0/8, ::1)."""
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return host == "localhost"


def url_for(host: str, port: int) -> str:
    """The URL to open for a server bound to ``host``: a wildcard address (0.0.0.0, ::) is shown as loopback,
    which reaches it from this machine (the address itself is not one a browser can open)."""
    if host in ("0.0.0.0", "::"):
        host = "127.0.0.1" if host == "0.0.0.0" else "::1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
