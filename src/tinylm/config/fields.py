"""The small type system of configuration fields: check a value against its annotation, parse a flag's text.

A configuration field is a dataclass field written with `setting`, its help text beside it:

    lr: float = setting(1e-3, "the peak learning rate")

Its annotation is one of int, float, bool, str, a ``Literal[...]`` of strings, or ``X | None``;
`check_type` says whether a value fits (TOML values and Python values alike), `parse_value` reads
command-line text ("4", "true", "none"). Both raise `TinyLMError`s that name what was expected.
argparse does not do this job because the same checks serve TOML files and Python dicts, which
never pass through argparse.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Sequence
from typing import Any, Literal

from tinylm.errors import TinyLMError


def setting(default: Any, help: str) -> Any:
    """A configuration field: its default and its help text (what `tinylm train --help` prints for its flag)."""
    return dataclasses.field(default=default, metadata={"help": help})


def field_help(cls: type, name: str) -> str:
    """The help text written beside field ``name`` of the configuration dataclass ``cls``."""
    return next(f.metadata["help"] for f in dataclasses.fields(cls) if f.name == name)


def check_fields(obj: Any) -> None:
    """Check (and coerce: ints to floats) every field of a configuration dataclass against its annotation."""
    hints = field_types(type(obj))
    for f in dataclasses.fields(obj):
        setattr(obj, f.name, check_type(f.name, getattr(obj, f.name), hints[f.name]))


def check_type(name: str, value: Any, tp: Any) -> Any:
    """``value`` if it fits the annotation ``tp`` (ints are accepted as floats), else a `TinyLMError`.

    Handles the annotations configuration fields use: int, float, bool, str, Literal[...] and
    ``X | None``.
    """
    origin = typing.get_origin(tp)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices or not isinstance(value, str):
            raise TinyLMError(f"{name} must be one of {', '.join(repr(c) for c in choices)}; got {value!r}")
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None:
            return None
        return check_type(name, value, optional_inner(tp))
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    else:
        raise TypeError(f"configuration fields cannot have the annotation {tp!r}")
    raise TinyLMError(f"{name} expects {_describe(tp)}, got {value!r} ({type(value).__name__})")


def parse_value(name: str, text: str, tp: Any) -> Any:
    """Command-line text to a value of type ``tp``: "4" -> 4, "true" -> True, "none" -> None (for ``X | None``)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        if text.strip().lower() in ("none", "null", "auto", "default"):
            return None
        return parse_value(name, text, optional_inner(tp))
    s = text.strip()
    try:
        if tp is bool:
            if s.lower() in ("true", "yes", "on", "1"):
                return True
            if s.lower() in ("false", "no", "off", "0"):
                return False
            raise ValueError
        if tp is int:
            return int(s)
        if tp is float:
            return float(s)
    except ValueError:
        raise TinyLMError(f"{name} expects {_describe(tp)}, got {text!r}") from None
    return text


def optional_inner(tp: Any) -> Any:
    """X for the annotation ``X | None``; ``tp`` itself for any other."""
    if typing.get_origin(tp) not in (typing.Union, types.UnionType):
        return tp
    (inner,) = [a for a in typing.get_args(tp) if a is not type(None)]
    return inner


def _describe(tp: Any) -> str:
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(tp, repr(tp))


def field_types(cls: type) -> dict[str, Any]:
    """Field name -> its annotation, resolved, for a configuration dataclass (in field order)."""
    # Field annotations are strings under `from __future__ import annotations`; resolve them once.
    hints = _HINTS.get(cls)
    if hints is None:
        resolved = typing.get_type_hints(cls)
        hints = _HINTS[cls] = {f.name: resolved[f.name] for f in dataclasses.fields(cls)}
    return hints


_HINTS: dict[type, dict[str, Any]] = {}


def did_you_mean(word: str, options: Sequence[str]) -> str:
    """`` (did you mean 'x'?)`` for the option closest to ``word``, or "" when none is close."""
    close = difflib.get_close_matches(word, options, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""
