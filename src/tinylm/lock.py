"""One writer per folder: a lock that two tinylm processes cannot both hold, and that a kill cannot leave stuck.

Two `tinylm train` runs into one run folder (or two `tinylm prepare` into one data folder) would
share temporary checkpoint folders, interleave metrics.jsonl and leave one run's configuration
beside the other's weights. So every command that writes a run or data folder holds its lock
while it writes::

    with folder_lock(out, "train"):
        ...                      # a second process gets a TinyLMError naming this one

The lock is the kernel's ``flock`` on a file ``.tinylm.lock`` inside the folder: the kernel
releases it when its process ends in any way (an exception, Ctrl-C, ``kill -9``), so a lock left
by a dead process is simply free and the next process takes it; no pid is trusted to decide
that. The pid and command written into the file are only for the message a second process
prints. On release the file is removed (and the folder too, if the lock made it and it is still
empty), so a refused command leaves nothing behind. Removing a lock file races with a process
that has it open and is about to lock it; that process checks after locking that the file it
holds is still the one at the path, and starts over if not.

``flock`` is advisory and local: it holds between processes of one machine (and on most network
file systems that support it), which is where two runs collide.
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from tinylm.errors import TinyLMError

LOCK_FILE = ".tinylm.lock"


def lock_path(folder: str | os.PathLike) -> Path:
    return Path(folder) / LOCK_FILE


@contextmanager
def folder_lock(folder: str | os.PathLike, what: str,
                wait: Callable[[str], None] | None = None) -> Iterator[Path]:
    """Hold the lock of ``folder`` (made if missing) while the block runs; ``what`` names the work for the
    message another process gets ("train", "prepare", "import"). If another process holds it: a TinyLMError,
    or with ``wait``, a line to ``wait`` saying who is waited for, then the lock once that process lets go."""
    folder = Path(folder)
    fd, made = _acquire(folder, what, wait)
    # "made": the folders this process made for the lock (the folder and any missing parents), removed again if
    # still empty when it lets go
    try:
        yield folder
    finally:
        _release(folder, fd, made)


def _acquire(folder: Path, what: str, wait: Callable[[str], None] | None) -> tuple[int, list[Path]]:
    """The locked file's descriptor, and the folders this process made for it (deepest first)."""
    path = lock_path(folder)
    blocking = False
    while True:
        made = [p for p in (folder, *folder.parents) if not p.exists()]
        try:
            folder.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except FileNotFoundError:
            continue  # the holder we waited for removed the folder it had made: make it again
        except OSError as e:
            raise TinyLMError(f"cannot lock {folder} (writing {path}: {e.strerror}); check the folder's "
                              "permissions and free space") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if blocking else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            if wait is None:
                raise TinyLMError(f"{folder} is in use by another tinylm process ({holder}); wait for it to end, or "
                                  "stop it, then try again") from None
            wait(f"waiting for another tinylm process to finish with {folder} ({holder})")
            blocking = True
            continue
        except BaseException:
            os.close(fd)
            raise
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # the holder removed the file between our open and our lock: lock the new one
    info = {"pid": os.getpid(), "what": what, "command": " ".join(_command()), "since": time.time()}
    try:
        os.ftruncate(fd, 0)
        os.write(fd, (json.dumps(info) + "\n").encode("utf-8"))
    except OSError:
        pass  # a full disk: the lock holds all the same; only another process's message lacks the pid
    return fd, made


def _release(folder: Path, fd: int, made: list[Path]) -> None:
    try:
        lock_path(folder).unlink(missing_ok=True)  # while still locked: see the module docstring
    except OSError:
        pass  # a read-only folder now: the kernel's lock goes with the descriptor all the same
    finally:
        os.close(fd)
    for path in made:
        try:
            path.rmdir()  # only if empty: a refused command leaves no folder behind
        except OSError:
            break


def _holder(fd: int) -> str:
    """Who holds the lock, as its file says: "pid 1234, `tinylm train --out runs/x`, for 3 min"."""
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        info = json.loads(os.read(fd, 65536).decode("utf-8"))
        since = max(0.0, time.time() - float(info["since"]))
        for_how_long = f"{since:.0f} s" if since < 120 else f"{since / 60:.0f} min"
        return f"pid {int(info['pid'])}, `{info['command']}`, for {for_how_long}"
    except (OSError, ValueError, KeyError, TypeError):
        return "its pid is not recorded yet"


def _command() -> list[str]:
    argv = list(sys.argv)
    if argv and Path(argv[0]).name in ("__main__.py", "tinylm"):
        argv[0] = "tinylm"
    return argv
