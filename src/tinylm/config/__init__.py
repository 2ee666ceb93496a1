"""Configuration as data: the model's and the training's settings, named presets, TOML files and overrides.

A run's configuration is a small TOML document with one table per part of the pipeline:
``[model]`` (the fields of `GPTConfig`: the network's shape) and ``[train]`` (the fields of
`TrainConfig`: data, optimizer, schedule, budget, evaluation, device).

    [model]
    n_layer = 4
    d_model = 192
    positions = "rope"

    [train]
    batch_size = 32
    lr = 2e-3
    max_tokens = 20_000_000

Where settings come from, later ones winning (`resolve_config`, which `tinylm train` calls too):

1. the dataclass defaults (`GPTConfig()` is GPT-2 small, like nanoGPT's),
2. a named preset (``src/tinylm/presets/<name>.toml``, see `list_presets`): the one asked for,
   else the one a file names, else the family's (lstm, rnn) or tiny,
3. a TOML file of the user's; a top-level ``preset = "tiny"`` line in it starts from that preset,
4. command-line style overrides, ``["--n-layer", "6", "--positions=rope", "--no-bias"]`` or a
   dict ``{"n_layer": 6}``; a key may be qualified by its table (``--model.n-layer``) and must be
   when two tables share a name.

Unknown keys and values of the wrong type are `TinyLMError`s that name the valid keys or the
expected type; impossible combinations are rejected by the dataclasses themselves.

Usage::

    cfg = resolve_config(preset="tiny", overrides=["--n-layer", "6", "--lr", "1e-3"])
    model = GPT(cfg.model)
    text = dump_toml(cfg.to_dict())        # the resolved configuration, saved with the run

The modules: `fields` (a field's type and help), `model` (`GPTConfig`), `training`
(`TrainConfig`), `tables` (`Config`, presets, files, overrides, TOML out), `resolve` (the policy:
which preset, fine-tuning, resuming, the run folder's name). The package imports nothing heavier
than the standard library: it sits at the bottom of tinylm, so anything may read a configuration
without importing torch.
"""

from tinylm.config.fields import check_type, field_help, field_types, parse_value, setting
from tinylm.config.model import FAMILY_NAMES, NGRAM_ONLY, SWIGLU_MULTIPLE, TRANSFORMER_ONLY, GPTConfig
from tinylm.config.resolve import (DEFAULT_PRESET, corpus_stem, default_run_dir, resolve_config,
                                   tie_without_head_settings, unused_settings)
from tinylm.config.tables import (SECTIONS, Config, apply_overrides, build_config, dump_toml, list_presets,
                                  load_config_file, load_preset, merge_tables, override_keys)
from tinylm.config.training import LOG_BACKENDS, TrainConfig

__all__ = [
    "DEFAULT_PRESET", "FAMILY_NAMES", "LOG_BACKENDS", "NGRAM_ONLY", "SECTIONS", "SWIGLU_MULTIPLE", "TRANSFORMER_ONLY",
    "Config", "GPTConfig", "TrainConfig", "apply_overrides", "build_config", "check_type", "corpus_stem",
    "default_run_dir", "dump_toml", "field_help", "field_types", "list_presets", "load_config_file", "load_preset",
    "merge_tables", "override_keys", "parse_value", "resolve_config", "setting", "tie_without_head_settings",
    "unused_settings",
]
