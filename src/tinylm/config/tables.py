"""A run's configuration as TOML tables: `Config`, the presets, configuration files, overrides, TOML out.

Every helper works table by table on nested dicts ``{"model": {...}, "train": {...}}``, so adding
a table is a new entry in `SECTIONS`; `build_config` turns such a dict into the checked dataclasses.
Values are checked against the fields' annotations as they are read (`tinylm.config.fields`), so a
TOML file, a dict and a command-line flag give the same errors.

    cfg = apply_overrides(load_preset("tiny"), ["--n-layer", "6", "--no-bias"])
    config = build_config(cfg)
    text = dump_toml(config.to_dict())        # reads back to the same with load_config_file
"""

from __future__ import annotations

import dataclasses
import json
import math
import tomllib
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from tinylm.config.fields import check_type, did_you_mean, field_types, parse_value
from tinylm.config.model import GPTConfig
from tinylm.config.training import TrainConfig
from tinylm.errors import TinyLMError


@dataclass
class Config:
    """A whole run's configuration: one dataclass per TOML table."""

    model: GPTConfig = field(default_factory=GPTConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def __post_init__(self) -> None:
        self.train.check_windows(self.model.block_size)  # the one check that needs both tables

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """The nested dict `dump_toml` writes; fields left as None (meaning "the default rule") are omitted."""
        return {
            f.name: {k: v for k, v in dataclasses.asdict(getattr(self, f.name)).items() if v is not None}
            for f in dataclasses.fields(self)
        }


# table name -> the dataclass its keys are the fields of
SECTIONS: dict[str, type] = {"model": GPTConfig, "train": TrainConfig}


# -- presets and files ---------------------------------------------------------------------------


def list_presets() -> list[str]:
    """The names of the presets shipped in ``tinylm/presets``."""
    folder = resources.files("tinylm") / "presets"
    return sorted(p.name.removesuffix(".toml") for p in folder.iterdir() if p.name.endswith(".toml"))


def load_preset(name: str) -> dict[str, dict[str, Any]]:
    """A named preset as a nested dict ``{"model": {...}}``, checked like any configuration file."""
    return _load_preset(name, seen=())


def load_config_file(path: str | Path, default_preset: str | None = None,
                     own_only: bool = False) -> dict[str, dict[str, Any]]:
    """A TOML configuration file as a nested dict, merged over its ``preset = "..."`` if it names one,
    else over ``default_preset`` (`tinylm train --config` gives "tiny", where the command starts).
    ``own_only``: the file's own tables alone, over no preset."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise TinyLMError(f"configuration file not found: {path}") from None
    except OSError as e:
        raise TinyLMError(f"cannot read configuration file {path}: {e.strerror}") from None
    return _parse_toml(text, source=str(path), seen=(), default_preset=default_preset, own_only=own_only)


def _load_preset(name: str, seen: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    if name in seen:
        raise TinyLMError(f"preset {name!r} includes itself through {' -> '.join(seen + (name,))}")
    resource = resources.files("tinylm") / "presets" / f"{name}.toml"
    if not resource.is_file():
        raise TinyLMError(f"unknown preset {name!r}{did_you_mean(name, list_presets())}; "
                          f"the presets are: {', '.join(list_presets())}")
    return _parse_toml(resource.read_text(encoding="utf-8"), source=f"preset {name!r}", seen=seen + (name,))


def _parse_toml(text: str, source: str, seen: tuple[str, ...],
                default_preset: str | None = None, own_only: bool = False) -> dict[str, dict[str, Any]]:
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise TinyLMError(f"{source} is not valid TOML: {e}") from None
    base: dict[str, dict[str, Any]] = _load_preset(default_preset, seen) if default_preset else {}
    if "preset" in raw:
        preset = raw.pop("preset")
        if not isinstance(preset, str):
            raise TinyLMError(f"{source}: 'preset' must be a preset name in quotes, got {preset!r}")
        base = _load_preset(preset, seen)
    if own_only:
        base = {}
    for key, table in raw.items():
        if key not in SECTIONS or not isinstance(table, dict):
            raise TinyLMError(
                f"{source}: unexpected {'table [' + key + ']' if isinstance(table, dict) else 'key ' + repr(key)}; "
                f"a configuration has the tables {', '.join('[' + s + ']' for s in SECTIONS)} "
                f"and an optional top-level preset = \"name\""
            )
        cls = SECTIONS[key]
        hints = field_types(cls)
        for name, value in table.items():
            if name not in hints:
                raise TinyLMError(f"{source}: unknown key {name!r} in [{key}]{did_you_mean(name, list(hints))}; "
                                  f"the valid keys are: {', '.join(hints)}")
            check_type(f"{key}.{name}", value, hints[name])
    return merge_tables(base, raw)


def merge_tables(base: Mapping[str, Mapping[str, Any]],
                 top: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """A copy of ``base`` with the keys of ``top`` set over it, table by table."""
    merged = {section: dict(table) for section, table in base.items()}
    for section, table in top.items():
        merged.setdefault(section, {}).update(table)
    return merged


# -- overrides -----------------------------------------------------------------------------------


def apply_overrides(
    cfg: Mapping[str, Mapping[str, Any]], overrides: Sequence[str] | Mapping[str, Any]
) -> dict[str, dict[str, Any]]:
    """A copy of ``cfg`` with the overrides applied.

    ``overrides`` is either command-line style, ``["--n-layer", "6", "--positions=rope"]`` (a bool
    key alone means true, ``--no-<key>`` means false), or a dict ``{"n_layer": 6, "model.bias":
    False}``; dict values that are strings are parsed like command-line text. Keys use dashes or
    underscores alike.
    """
    out = merge_tables(cfg, {})
    pairs = _override_pairs(overrides)
    for flag, value in pairs:
        section, name = _resolve_key(flag)
        tp = field_types(SECTIONS[section])[name]
        label = f"--{name.replace('_', '-')}"
        if isinstance(value, str) and tp is not str and typing.get_origin(tp) is not Literal:
            value = parse_value(label, value, tp)
        out.setdefault(section, {})[name] = check_type(label, value, tp)
        if value is None:
            del out[section][name]  # None means "use the default rule": the same as leaving the key out
    return out


def _override_pairs(overrides: Sequence[str] | Mapping[str, Any]) -> list[tuple[str, Any]]:
    if isinstance(overrides, Mapping):
        return list(overrides.items())
    if isinstance(overrides, str):
        raise TinyLMError("overrides must be a list of arguments such as ['--n-layer', '4'], not one string")
    pairs: list[tuple[str, Any]] = []
    args = list(overrides)
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise TinyLMError(f"expected a setting such as --n-layer, got {arg!r}")
        key, eq, value = arg[2:].partition("=")
        if eq:
            pairs.append((key, value))
            i += 1
            continue
        if i + 1 < len(args) and not args[i + 1].startswith("--"):
            pairs.append((key, args[i + 1]))
            i += 2
            continue
        # a bare flag: `--bias` is true and `--no-bias` false; anything else needs a value
        negated = key.startswith(("no-", "no_")) and _is_bool_key(key[3:])
        section, name = _resolve_key(key[3:] if negated else key)
        if not _is_bool_key(f"{section}.{name}"):
            raise TinyLMError(f"--{key} needs a value, e.g. --{key} VALUE or --{key}=VALUE")
        pairs.append((f"{section}.{name}", not negated))
        i += 1
    return pairs


def override_keys(overrides: Sequence[str] | Mapping[str, Any]) -> list[tuple[str, str]]:
    """``(table, field)`` of every setting ``overrides`` name, in order: ``[("model", "n_layer")]`` for
    ``["--n-layer", "6"]``."""
    return [_resolve_key(key) for key, _ in _override_pairs(overrides)]


def _is_bool_key(key: str) -> bool:
    try:
        section, name = _resolve_key(key)
    except TinyLMError:
        return False
    return field_types(SECTIONS[section])[name] is bool


def _resolve_key(key: str) -> tuple[str, str]:
    """``"n-layer"`` or ``"model.n_layer"`` -> ``("model", "n_layer")``, or an error naming the valid keys."""
    key = key.removeprefix("--").replace("-", "_")
    section, dot, name = key.rpartition(".")
    if dot:
        if section not in SECTIONS:
            raise TinyLMError(f"unknown table {section!r} in --{key}; the tables are: {', '.join(SECTIONS)}")
        candidates = [section] if name in field_types(SECTIONS[section]) else []
    else:
        candidates = [s for s, cls in SECTIONS.items() if name in field_types(cls)]
    if len(candidates) == 1:
        return candidates[0], name
    if len(candidates) > 1:
        raise TinyLMError(f"--{name} is ambiguous; say which table: " + ", ".join(f"--{s}.{name}" for s in candidates))
    valid = [f"--{n.replace('_', '-')}" for s, cls in SECTIONS.items() if not dot or s == section
             for n in field_types(cls)]
    flag = "--" + name.replace("_", "-")
    raise TinyLMError(f"unknown setting {flag}{did_you_mean(flag, valid)}; the valid settings are: {', '.join(valid)}")


# -- building and writing ------------------------------------------------------------------------


def build_config(cfg: Mapping[str, Mapping[str, Any]]) -> Config:
    """The dataclasses for a nested dict; unknown tables and keys are errors, then each dataclass validates itself."""
    kwargs = {}
    for section, table in cfg.items():
        if section not in SECTIONS:
            raise TinyLMError(f"unknown table [{section}]; the tables are: {', '.join(SECTIONS)}")
        hints = field_types(SECTIONS[section])
        unknown = [k for k in table if k not in hints]
        if unknown:
            raise TinyLMError(f"unknown key {unknown[0]!r} in [{section}]{did_you_mean(unknown[0], list(hints))}; "
                              f"the valid keys are: {', '.join(hints)}")
        kwargs[section] = SECTIONS[section](**table)
    return Config(**kwargs)


def dump_toml(cfg: Mapping[str, Mapping[str, Any]]) -> str:
    """A nested dict of scalars as TOML text that `load_config_file` reads back to the same dict."""
    lines: list[str] = []
    for section, table in cfg.items():
        lines.append(f"[{section}]")
        for key, value in table.items():
            if value is not None:
                lines.append(f"{key} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)  # repr is the shortest text that reads back to the same float
    if isinstance(value, str):
        return json.dumps(value)  # TOML basic strings escape like JSON strings
    raise TinyLMError(f"cannot write {value!r} ({type(value).__name__}) as a TOML value")
