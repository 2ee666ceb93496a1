"""Worker processes: a pool that starts clean, keeps the order, and ends with the process that started it.

Tokenizer training counts chunks, and `prepare` tokenizes documents, in a few processes at once::

    for batch, counts in in_order(count, batches, workers=2, died="a counting worker died"):
        total.update(counts)

Each rule here answers a way a pool went wrong:

- Workers are spawned (a fresh interpreter), never forked. A fork copies the parent with every lock
  that its other threads held at that instant (torch's thread pool, tqdm's monitor, a test runner's
  reader), so a child can wait for ever on a lock that nobody will release; and it inherits
  tinylm's SIGTERM handler, Python code that a stuck child never gets to run, so ending the pool
  waited for ever too.
- A spawned worker does not run the caller's script. Plain "spawn" imports ``__main__`` again in
  every worker, so a script that trains a tokenizer at its top level, with no ``if __name__ ==
  "__main__"`` guard, would start over in each of them; the work here is tinylm's own functions,
  which need nothing of the script, so ``__main__`` is hidden while the workers start (as joblib's
  workers do).
- At most two items per worker are in flight and results come back in the items' order, so memory
  stays bounded whatever the input's size (``Executor.map`` would read all of it into its queue).
- A worker that dies (killed for memory, say) fails the call with one line instead of leaving it
  waiting for a result that will never come (``concurrent.futures``, not ``multiprocessing.Pool``).
- A worker ends as soon as its parent is gone, however it went (kill -9 included): its siblings hold
  the task queue open, so no end-of-file would ever wake it.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import signal
import sys
import threading
import time
import types
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, TypeVar

from tinylm.errors import TinyLMError

Item = TypeVar("Item")
Result = TypeVar("Result")


def in_order(work: Callable[[Item], Result], items: Iterable[Item], *, workers: int, died: str,
             initializer: Callable[..., None] | None = None, initargs: tuple[Any, ...] = ()
             ) -> Iterator[tuple[Item, Result]]:
    """``(item, work(item))`` for each item, in order, computed by ``workers`` spawned processes.

    ``work`` and ``initializer`` must be module-level functions (or partials of them): a spawned
    process imports them by name. ``died``: what the error says when a worker process dies.
    """
    pool = ProcessPoolExecutor(workers, multiprocessing.get_context("spawn"), _start_worker,
                               (os.getpid(), initializer, initargs))
    try:
        pending: deque[tuple[Item, Future[Result]]] = deque()
        for item in items:
            with _script_hidden():  # a submit may start a worker process
                pending.append((item, pool.submit(work, item)))
            if len(pending) >= 2 * workers:
                done, future = pending.popleft()
                yield done, _result(future, died)
        while pending:
            done, future = pending.popleft()
            yield done, _result(future, died)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


@contextlib.contextmanager
def _script_hidden() -> Iterator[None]:
    """While a worker is spawned, ``__main__`` is an empty module: the worker imports nothing of the caller's script."""
    script = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = script


def _result(future: Future[Result], died: str) -> Result:
    try:
        return future.result()
    except BrokenProcessPool:
        raise TinyLMError(f"{died} (out of memory, or killed); run again with --workers 1 to work in this process "
                          "and see the error") from None


def _start_worker(parent: int, initializer: Callable[..., None] | None, initargs: tuple[Any, ...]) -> None:
    die_with(parent)
    if initializer is not None:
        initializer(*initargs)


_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def die_with(parent: int) -> None:
    """End this process as soon as ``parent`` is gone, however it went.

    On Linux the kernel kills it with its parent (PR_SET_PDEATHSIG); on every system a daemon thread
    also looks twice a second whether the parent is still there, which covers the instant before the
    prctl call and systems without it.
    """
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):  # no prctl to call: the thread below still watches
            pass
    ppid = os.getppid()

    def orphaned() -> bool:
        # a process that is gone leaves its children to another parent (init, or a subreaper)
        return os.getppid() != ppid or (ppid != parent and not running(parent))

    if orphaned():
        os._exit(1)

    def watch() -> None:
        while not orphaned():
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="tinylm-watch-parent", daemon=True).start()


def alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (a zombie counts)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def running(pid: int) -> bool:
    """Whether the process ``pid`` still runs: a killed one that nobody has reaped yet (a zombie) does not."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            # "pid (name) state ...": the name may hold spaces and parentheses, so read after the last ")"
            return f.read().rpartition(b")")[2].split()[0] not in (b"Z", b"X")
    except (OSError, IndexError):
        return alive(pid)  # no /proc: a zombie counts as running, and the prctl or ppid check decides
