"""tinylm's versioned JSON files, read one way: the file names its kind (``"format"``) and its layout
(``"version"``), and a reader checks both before trusting anything else in it.

Each kind of file read this way (a tokenizer, a shard folder's meta.json, an n-gram model's header, a
run's run.json and cost.json, a checkpoint's state.json and checksums.json) is one `JSONFormat`: its
name, the version this tinylm writes and reads, and what to tell the user for each way a file can be
wrong: missing, unreadable, not valid JSON, another kind of file, another version. The messages are
templates; they may use ``{path}`` (the file), ``{folder}`` and ``{file}`` (its folder and its name),
``{name}`` and ``{version}`` (the format's), ``{found}`` (the version the file holds), ``{error}``,
``{line}`` and ``{column}`` (what the reader met), and any ``context`` the caller passes (a function
there is called only when a message is made, for what costs something to find out). Every message is
one line that says what to do::

    SHARDS = JSONFormat("tinylm.shards", 1, missing="{folder} has no {file}; run `tinylm prepare` into it", ...)
    meta = SHARDS.read(folder / "meta.json")                       # a dict, or a TinyLMError
    atomic_write_text(path, json.dumps({**SHARDS.header(), "splits": ...}))

The JSON files of other tools (a model's config.json, a tokenizer.json) have no such header: each is read
by `read_json_object`, with the same one-line errors and one more, ``{kind}``, for a file that holds
something other than an object. Both parse with `parse_json`, which refuses nesting deeper than any real
file has in one line.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
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


def json_kind(value: Any) -> str:
    """What a parsed JSON value is, in JSON's words ("a list", "null"), for messages about the wrong kind."""
    kinds = {dict: "an object", list: "a list", str: "a string", bool: "true or false", int: "a number",
             float: "a number", type(None): "null"}
    return kinds.get(type(value), type(value).__name__)


def read_json_object(path: str | os.PathLike, *, missing: str = "{path} does not exist",
                     unreadable: str = "cannot read {path}: {error}",
                     corrupt: str = "{path} is not valid JSON (line {line}, column {column})",
                     not_object: str = "{path} is {kind}, not a JSON object", **context: Any) -> dict[str, Any]:
    """The JSON object in the file at ``path``, a file of another tool; a `TinyLMError` with the template (module
    docstring) for each way it can be wrong: missing, unreadable, not valid JSON, too deep, not an object."""
    path = Path(path)
    data = _parse_file(path, missing, unreadable, corrupt, context)
    if not isinstance(data, dict):
        raise TinyLMError(_message(not_object, path, context, kind=json_kind(data)))
    return data


def _parse_file(path: Path, missing: str, unreadable: str, corrupt: str, context: dict[str, Any]) -> Any:
    """The parsed contents of the file at ``path``, or a `TinyLMError` with the template for what went wrong."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise TinyLMError(_message(missing, path, context)) from None
    except (OSError, UnicodeDecodeError) as e:
        raise TinyLMError(_message(unreadable, path, context, error=e)) from None
    try:
        return parse_json(text, path)
    except json.JSONDecodeError as e:
        raise TinyLMError(_message(corrupt, path, context, error=e, line=e.lineno, column=e.colno)) from None


def _message(template: str, path: Path, context: dict[str, Any], **found: Any) -> str:
    """``template`` filled in for the file ``path``; a function in ``context`` is called now, for this message."""
    return template.format(path=path, folder=path.parent, file=path.name, **found,
                           **{key: value() if callable(value) else value for key, value in context.items()})


@dataclass(frozen=True)
class JSONFormat:
    """A kind of versioned JSON file, and the one-line errors for a file that is not one (module docstring)."""

    name: str  # the "format" field, e.g. "tinylm.tokenizer"
    version: int | None  # the "version" this tinylm writes and reads; None: its files have none
    foreign: str  # not a JSON object, or one of another format, or (with `valid`) not a sound one
    wrong_version: str = "{path} has format version {found!r}, but this tinylm reads version {version}"
    missing: str = "{path} does not exist"
    unreadable: str = "{path} is unreadable ({error})"  # an OSError, not UTF-8, or (with no `corrupt`) bad JSON
    corrupt: str | None = None  # not valid JSON; None: say `unreadable`
    any_version: bool = False  # read a file of any version all the same (the version is written, never checked)
    valid: Callable[[dict[str, Any]], bool] | None = None  # a last check of a file of this format and version

    def header(self) -> dict[str, Any]:
        """The fields every file of this format starts with: its format, and its version if it has one."""
        return {"format": self.name} if self.version is None else {"format": self.name, "version": self.version}

    def read(self, path: str | os.PathLike, **context: Any) -> dict[str, Any]:
        """The checked contents of the file at ``path``; a `TinyLMError` with this format's message if it is wrong."""
        path = Path(path)
        corrupt = self.unreadable if self.corrupt is None else self.corrupt
        data = _parse_file(path, self.missing, self.unreadable, corrupt, self._context(context))
        return self.check(data, path, **context)

    def check(self, data: Any, path: str | os.PathLike, **context: Any) -> dict[str, Any]:
        """``data`` (parsed from ``path``) if it is an object of this format and version, else a `TinyLMError`."""
        path = Path(path)
        if not isinstance(data, dict) or data.get("format") != self.name:
            raise TinyLMError(_message(self.foreign, path, self._context(context)))
        if self.version is not None and not self.any_version and data.get("version") != self.version:
            raise TinyLMError(_message(self.wrong_version, path, self._context(context), found=data.get("version")))
        if self.valid is not None and not self.valid(data):
            raise TinyLMError(_message(self.foreign, path, self._context(context)))
        return data

    def _context(self, context: dict[str, Any]) -> dict[str, Any]:
        return {"name": self.name, "version": self.version, **context}
