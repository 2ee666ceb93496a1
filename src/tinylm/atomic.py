"""Writing files so that a crash, a kill or a full disk never leaves a half-written one.

A file tinylm writes whole (a tokenizer, run.json, an n-gram model, an exported model, a picture) is
written to a temporary file in the same folder and then renamed over the target with `os.replace`
(`atomic_path`, `atomic_write_text`), which is atomic on POSIX and Windows: a reader sees the old file
or the new one, never a mix. Checkpoint folders are replaced the same way a folder at a time
(`tinylm.checkpoint`), and token shards under temporary names renamed into place with meta.json last
(`tinylm.data.shards`).

A write the disk refuses (full, over quota, read-only, not permitted) is not a bug in tinylm, so it
is not a traceback either: `disk_writes` turns it into one `TinyLMError` line that names what could
not be written, why, what is still intact, and what to do. It is the one place that translates
these errors; `atomic_path`, checkpoint folders, token shards and exports all write inside it::

    with disk_writes(f"checkpoint {path}", intact="the checkpoint of step 200 is intact there",
                     retry="continue with --resume"):
        ...   # an OSError(ENOSPC) here becomes
              # "cannot write checkpoint ...: no space left on device; the checkpoint of step 200 is
              #  intact there; free some space and continue with --resume"
"""

from __future__ import annotations

import errno
import os
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from tinylm.errors import TinyLMError

# errno -> (what happened, what the user can do about it). Only failures of the disk itself: any other
# OSError in a write (a path that is a folder, a name too long) keeps its own handling.
_DISK_FAILURES: dict[int, tuple[str, str]] = {
    errno.ENOSPC: ("no space left on device", "free some space"),
    errno.EROFS: ("the file system is read-only", "make it writable or write somewhere else"),
    errno.EACCES: ("permission denied", "make the folder writable for you or write somewhere else"),
    errno.EPERM: ("operation not permitted", "make the folder writable for you or write somewhere else"),
}
if hasattr(errno, "EDQUOT"):  # not on Windows
    _DISK_FAILURES[errno.EDQUOT] = ("the disk quota is exceeded", "free some space or raise the quota")


class DiskWriteError(TinyLMError):
    """A write the disk refused, said as one line; ``cause`` is the OSError it came from.

    A `disk_writes` block around another one re-says it in its own terms: the outer block knows
    more about what was being written and what is intact (an export, not one of its files).
    """

    def __init__(self, message: str, cause: OSError) -> None:
        super().__init__(message)
        self.cause = cause


# numpy's `tofile` (which the gguf writer uses) reports a write the disk cut short as an OSError with no
# errno, "9664 requested and 288 written": a disk that takes part of a write and no more is a full one
_SHORT_WRITE = re.compile(r"\d+ requested and \d+ written")


def disk_failure(e: BaseException) -> tuple[str, str] | None:
    """(what happened, what to do) when ``e`` is the disk refusing a write, else None."""
    if isinstance(e, DiskWriteError):
        e = e.cause
    if not isinstance(e, OSError):
        return None
    if e.errno is None and _SHORT_WRITE.fullmatch(str(e)):
        return _DISK_FAILURES[errno.ENOSPC]
    return _DISK_FAILURES.get(e.errno)


@contextmanager
def disk_writes(what: str, intact: str | Callable[[], str], retry: str = "try again") -> Iterator[None]:
    """Turn a disk failure inside the block into a `DiskWriteError`: "cannot write {what}: {why};
    {intact}; {fix} and {retry}". ``intact`` may be a function, asked only once the write failed
    (what is intact is often only known then). Cleaning up is the block's own business: by the time
    the error leaves it, nothing half-written should be left."""
    try:
        yield
    except (OSError, DiskWriteError) as e:
        failure = disk_failure(e)
        if failure is None:
            raise
        why, fix = failure
        cause = e.cause if isinstance(e, DiskWriteError) else e
        said = intact() if callable(intact) else intact
        raise DiskWriteError(f"cannot write {what}: {why}; {said}; {fix} and {retry}", cause) from None


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path to write; on success it replaces ``path``, on error it is removed."""
    path = Path(path)
    existed = path.exists()
    intact = f"the {path.name} there before is intact" if existed else "nothing half-written is left there"
    with disk_writes(str(path), intact):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            yield tmp
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(path)
