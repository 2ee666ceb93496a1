"""tinylm's versioned JSON files, read one way: the file names its kind (``"format"``) and its layout
(``"version"``), and a reader checks both before trusting anything else in it.

Each kind of file read this way (a tokenizer, a shard folder's meta.json, an n-gram model's header, a
run's cost.json) is one `JSONFormat`: its name, the version this tinylm writes and reads, and
what to tell the user for each way a file can be wrong: missing, unreadable, not valid JSON, another
kind of file, another version. The messages are templates; they may use ``{path}`` (the file),
``{folder}`` and ``{file}`` (its folder and its name), ``{name}`` and ``{version}`` (the format's),
``{found}`` (the version the file holds), ``{error}``, ``{line}`` and ``{column}`` (what the reader
met), and any ``context`` the caller passes. Every message is one line that says what to do::

    SHARDS = JSONFormat("tinylm.shards", 1, missing="{folder} has no {file}; run `tinylm prepare` into it", ...)
    meta = SHARDS.read(folder / "meta.json")                       # a dict, or a TinyLMError
    atomic_write_text(path, json.dumps({**SHARDS.header(), "splits": ...}))

These, and the tokenizer.json and config.json files of other tools, are parsed by `parse_json`, which
refuses nesting deeper than any real file has in one line. (run.json, a checkpoint's state.json and
checksums.json are still read by hand in `tinylm.run` and `tinylm.checkpoint`.)
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tinylm.errors import TinyLMError

# Real files nest a few levels (a tokenizer.json's pipeline about six). json's parser raises RecursionError near
# 1000 levels, and a value nested just under that can still exhaust the stack of any code that walks it later,
# so a far lower limit makes every deeper file one clear line instead.
MAX_DEPTH = 100


def parse_json(text: str, source: str | os.PathLike) -> Any:
    """``json.loads(text)``, or a `TinyLMError` naming ``source`` if it nests deeper than `MAX_DEPTH`
    (a `json.JSONDecodeError` still means it is not JSON: each caller says what the file should be)."""
    try:
        data = json.loads(text)
    except RecursionError:
        data = None
        depth = MAX_DEPTH + 1
    else:
        depth = _depth(data)
    if depth > MAX_DEPTH:
        raise TinyLMError(f"{source} nests JSON objects or lists more than {MAX_DEPTH} levels deep, which no file "
                          "tinylm reads does; it is damaged or not the file it should be")
    return data


def _depth(data: Any) -> int:
    """How deep ``data`` nests, level by level without recursion; stops counting past `MAX_DEPTH`."""
    level = [data] if isinstance(data, (dict, list)) else []
    depth = 0
    while level and depth <= MAX_DEPTH:
        depth += 1
        inner = []
        for node in level:
            inner.extend(v for v in (node.values() if isinstance(node, dict) else node) if isinstance(v, (dict, list)))
        level = inner
    return depth


@dataclass(frozen=True)
class JSONFormat:
    """A kind of versioned JSON file, and the one-line errors for a file that is not one (module docstring)."""

    name: str  # the "format" field, e.g. "tinylm.tokenizer"
    version: int | None  # the "version" this tinylm writes and reads; None: any version is read
    foreign: str  # not a JSON object, or one of another format
    wrong_version: str = "{path} has format version {found!r}, but this tinylm reads version {version}"
    missing: str = "{path} does not exist"
    unreadable: str = "{path} is unreadable ({error})"  # an OSError, not UTF-8, or (with no `corrupt`) bad JSON
    corrupt: str | None = None  # not valid JSON; None: say `unreadable`

    def header(self) -> dict[str, Any]:
        """The two fields every file of this format starts with."""
        return {"format": self.name, "version": self.version}

    def read(self, path: str | os.PathLike, **context: Any) -> dict[str, Any]:
        """The checked contents of the file at ``path``; a `TinyLMError` with this format's message if it is wrong."""
        path = Path(path)
        where = self._where(path, context)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise TinyLMError(self.missing.format(**where)) from None
        except (OSError, UnicodeDecodeError) as e:
            raise TinyLMError(self.unreadable.format(error=e, **where)) from None
        try:
            data = parse_json(text, path)
        except json.JSONDecodeError as e:
            template = self.unreadable if self.corrupt is None else self.corrupt
            raise TinyLMError(template.format(error=e, line=e.lineno, column=e.colno, **where)) from None
        return self.check(data, path, **context)

    def check(self, data: Any, path: str | os.PathLike, **context: Any) -> dict[str, Any]:
        """``data`` (parsed from ``path``) if it is an object of this format and version, else a `TinyLMError`."""
        where = self._where(Path(path), context)
        if not isinstance(data, dict) or data.get("format") != self.name:
            raise TinyLMError(self.foreign.format(**where))
        if self.version is not None and data.get("version") != self.version:
            raise TinyLMError(self.wrong_version.format(found=data.get("version"), **where))
        return data

    def _where(self, path: Path, context: dict[str, Any]) -> dict[str, Any]:
        return {"path": path, "folder": path.parent, "file": path.name, "name": self.name, "version": self.version,
                **context}
