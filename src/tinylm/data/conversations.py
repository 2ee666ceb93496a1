"""Conversations for fine-tuning: read from a JSONL file, and split into training and held-out sets.

A conversation is a list of messages, each a plain dict ``{"role": ..., "content": ...}`` whose
role is ``"system"``, ``"user"`` or ``"assistant"`` and whose content is a string. They stay plain
dicts because a Jinja chat template reads them as they are.

`read_conversations` reads a JSON Lines file, one conversation per line, each line in any of the
three common formats (a file may mix them, line by line)::

    {"messages": [{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}
    {"prompt": "What is 2 + 2?", "completion": "4"}
    {"instruction": "Translate to French.", "input": "cheese", "output": "fromage"}

- OpenAI chat: ``messages`` is a list of messages. A content may also be a list of text parts,
  ``[{"type": "text", "text": ...}, ...]``, which are joined without a separator. The role
  ``developer`` (OpenAI's newer name for the system role) is read as ``system``; ``tool`` and
  other roles are refused, as tinylm does not train on them. A system message may only come
  first, and a conversation needs at least one assistant message, the part a model learns to
  write. Any other field of a line or of a message (``name``, ``weight``, ids) is left out.
- prompt/completion: the user's prompt and the assistant's completion, both strings.
- Alpaca: the user's message is the ``instruction``, followed by a blank line (``"\\n\\n"``) and
  the ``input`` when ``input`` is present and not empty; the assistant's message is ``output``.

Blank lines are skipped. Anything else is an error, one line naming the file, the line number,
what is wrong and how to fix it; the whole file is checked before anything trains on it.

`split_conversations` holds some conversations out for validation: which side a conversation
lands on depends on its content and the seed alone, not on where it sits in the file.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from tinylm.errors import TinyLMError

ROLES = ("system", "user", "assistant")
"""The roles of a message once read (``developer`` is read as ``system``)."""

MAX_LINE_BYTES = 4 * 1024 * 1024
"""The longest line read: far more text than any context a tinylm model is tuned with, so a longer line
is almost surely not a conversation (a whole file without newlines, a stray binary) and is refused
before it fills memory."""

_FORMATS = '{"messages": [...]}, {"prompt": ..., "completion": ...} or {"instruction": ..., "output": ...}'
_READ_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
_BOM = b"\xef\xbb\xbf"

Conversation = list[dict[str, str]]


class _RowError(Exception):
    """What is wrong with one line, without the file and line number (added where it is caught)."""


def read_conversations(path: str | os.PathLike) -> list[Conversation]:
    """Every conversation of a JSONL file, in file order, as lists of ``{"role", "content"}`` dicts.

    The formats accepted are described in the module docstring. The file is read as UTF-8 (a
    leading byte-order mark is dropped). Raises `TinyLMError` for a missing or unreadable file, a
    file with no conversations, and for the first bad line, naming its line number.
    """
    path = Path(path)
    if not path.exists():
        raise TinyLMError(f"conversation file {path} does not exist; give a .jsonl file with one conversation per line")
    if path.is_dir():
        raise TinyLMError(f"{path} is a folder; give a .jsonl file with one conversation per line")
    try:
        f = path.open("rb")
    except OSError as e:
        raise TinyLMError(f"cannot read {path}: {e.strerror or e}") from None
    conversations = []
    with f:
        lineno = 0
        while raw := f.readline(MAX_LINE_BYTES + 1):
            lineno += 1
            if len(raw) > MAX_LINE_BYTES:
                raise TinyLMError(
                    f"{path} line {lineno} is longer than {MAX_LINE_BYTES // (1024 * 1024)} MiB, far more than a "
                    "conversation to tune on; shorten or drop it (is the file JSONL, one conversation per line?)"
                )
            line = _decode_line(raw[len(_BOM):] if lineno == 1 and raw.startswith(_BOM) else raw, path, lineno)
            line = line.rstrip("\r\n")
            if not line.strip():
                continue
            try:
                conversations.append(_conversation(_parse_json(line)))
            except _RowError as e:
                raise TinyLMError(f"{path} line {lineno} {e}") from None
    if not conversations:
        raise TinyLMError(f"{path} holds no conversations (it is empty or all blank lines); write one JSON object "
                          f"per line: {_FORMATS}")
    return conversations


def _decode_line(raw: bytes, path: Path, lineno: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise TinyLMError(
            f"{path} line {lineno} is not valid UTF-8 (byte 0x{raw[e.start]:02x} at byte {e.start + 1} of the line); "
            "convert the file to UTF-8 (e.g. iconv -f latin1 -t utf-8)"
        ) from None


def _parse_json(line: str) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError as e:
        # the column counted in the line without its newline, where JSON's own would start a line 2 at the end
        raise _RowError(f"is not valid JSON ({e.msg} at column {e.pos + 1}); fix or remove that line") from None
    except RecursionError:
        raise _RowError("nests JSON too deeply to be a conversation; fix or remove that line") from None


def _conversation(record: Any) -> Conversation:
    """One line's JSON value as a conversation, in whichever of the three formats it is."""
    if not isinstance(record, dict):
        raise _RowError(f"is a JSON {_json_type(record)}, not an object; each line is one conversation: {_FORMATS}")
    shapes = [name for name, keys in (("messages", ("messages",)), ("prompt/completion", ("prompt", "completion")),
                                      ("Alpaca", ("instruction", "output"))) if any(k in record for k in keys)]
    if len(shapes) > 1:
        raise _RowError(f"mixes the {' and '.join(shapes)} formats (its fields: {_keys(record)}); "
                        "keep one format per line")
    if not shapes:
        raise _RowError(f"is in none of the formats read (its fields: {_keys(record)}); write {_FORMATS}")
    if shapes[0] == "messages":
        return _chat(record["messages"])
    if shapes[0] == "prompt/completion":
        prompt, completion = _string_field(record, "prompt"), _string_field(record, "completion")
        return [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
    instruction, output = _string_field(record, "instruction"), _string_field(record, "output")
    extra = _string_field(record, "input") if "input" in record else ""
    user = f"{instruction}\n\n{extra}" if extra else instruction
    return [{"role": "user", "content": user}, {"role": "assistant", "content": output}]


def _string_field(record: dict, key: str) -> str:
    if key not in record:
        raise _RowError(f"has no {key!r} field (its fields: {_keys(record)}); add it")
    value = record[key]
    if not isinstance(value, str):
        raise _RowError(f"has the field {key!r} as a JSON {_json_type(value)}, not a string")
    return value


def _chat(messages: Any) -> Conversation:
    """An OpenAI ``messages`` list as a conversation: roles checked, parts joined, other fields left out."""
    if not isinstance(messages, list) or not messages:
        what = "an empty list" if isinstance(messages, list) else f"a JSON {_json_type(messages)}"
        raise _RowError(f'has "messages" that is {what}, not a list of {{"role": ..., "content": ...}} objects')
    conversation = []
    for i, message in enumerate(messages, start=1):
        if not isinstance(message, dict):
            raise _RowError(f"has a bad message {i}: a JSON {_json_type(message)}, not an object with a role and "
                            "a content")
        for key in ("role", "content"):
            if key not in message:
                raise _RowError(f"has a bad message {i}: it has no {key!r} (its fields: {_keys(message)})")
        role = message["role"]
        if not isinstance(role, str):
            raise _RowError(f"has a bad message {i}: its role is a JSON {_json_type(role)}, not a string; "
                            f"roles are {', '.join(_READ_ROLES)}")
        if role not in _READ_ROLES:
            raise _RowError(f"has a bad message {i}: its role {role!r} is not one tinylm trains on; "
                            f"roles are {', '.join(_READ_ROLES)}")
        role = _READ_ROLES[role]
        if role == "system" and i > 1:
            raise _RowError(f"has a bad message {i}: a system message, which may only come first")
        conversation.append({"role": role, "content": _content(message["content"], i)})
    if not any(m["role"] == "assistant" for m in conversation):
        raise _RowError("has no assistant message, so nothing to learn to write; add the assistant's reply")
    return conversation


def _content(content: Any, i: int) -> str:
    """A message's content: a string, or a list of text parts joined together."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _RowError(f"has a bad message {i}: its content is a JSON {_json_type(content)}, not a string "
                        '(or a list of {"type": "text", "text": ...} parts)')
    texts = []
    for j, part in enumerate(content, start=1):
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = f"of type {part.get('type')!r}" if isinstance(part, dict) else f"a JSON {_json_type(part)}"
            raise _RowError(f"has a bad message {i}: its content part {j} is {kind}; only text parts "
                            '{"type": "text", "text": "..."} can be read')
        if not isinstance(part.get("text"), str):
            raise _RowError(f"has a bad message {i}: its content part {j} has a 'text' that is a JSON "
                            f"{_json_type(part.get('text'))}, not a string")
        texts.append(part["text"])
    return "".join(texts)


def _json_type(value: Any) -> str:
    for kind, name in ((bool, "boolean"), (str, "string"), ((int, float), "number"), (list, "list"), (dict, "object")):
        if isinstance(value, kind):
            return name
    return "null"


def _keys(record: dict) -> str:
    return ", ".join(sorted(record)) or "none"


# ----- the held-out split -------------------------------------------------------------------------


def split_conversations(
    conversations: list[Conversation], val_fraction: float, seed: int
) -> tuple[list[Conversation], list[Conversation]]:
    """(train, val): about ``val_fraction`` of the conversations held out, the same ones for the same seed.

    Each conversation gets a key, the first 8 bytes of ``sha256(seed, conversation)``, and the
    ``round(n * val_fraction)`` conversations with the smallest keys validate (at least one, and at
    least one left to train on). The key depends on a conversation's content alone, so shuffling
    the file or adding lines elsewhere does not move it to the other side unless the count requires
    it. Copies of one conversation share a key and land on the same side (all of them validate when
    the cut falls among them, or all train when that would leave nothing to train on), so a repeated
    example never validates on what it trained on. Both lists keep the order of ``conversations``.
    """
    if not 0 < val_fraction < 1:
        raise TinyLMError(f"val_fraction must be strictly between 0 and 1 (a share of the conversations to hold "
                          f"out), got {val_fraction}")
    n = len(conversations)
    if n < 2:
        raise TinyLMError(f"only {n} conversation{'' if n == 1 else 's'} to split; holding some out for validation "
                          "needs at least two (one to train on, one to validate)")
    keys = [_split_key(seed, c) for c in conversations]
    ranked = sorted(keys)
    n_val = min(max(round(n * val_fraction), 1), n - 1)
    threshold = ranked[n_val - 1]
    if threshold == ranked[-1]:  # the copies at the cut fill the rest: they train, the smaller keys validate
        if threshold == ranked[0]:
            raise TinyLMError(f"all {n} conversations are the same, so none can be held out that was not also "
                              "trained on; give different conversations")
        is_val = [k < threshold for k in keys]
    else:
        is_val = [k <= threshold for k in keys]
    train = [c for c, v in zip(conversations, is_val) if not v]
    val = [c for c, v in zip(conversations, is_val) if v]
    return train, val


def _split_key(seed: int, conversation: Conversation) -> int:
    text = json.dumps(conversation, ensure_ascii=False, sort_keys=True, separators=(",", ":"))
    digest = hashlib.sha256(f"{seed}\0{text}".encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big")
