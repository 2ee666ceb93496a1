"""Where a run's settings come from: `resolve_config`, the one answer for the command and for Python.

`tinylm train` parses its flags and calls `resolve_config` and `default_run_dir` with them; a
script calling them with the same arguments gets the same configuration and the same folder:

    config = resolve_config(overrides={"family": "lstm"})       # = tinylm train --model lstm
    config = resolve_config(path="my-run.toml", overrides=["--warmup-steps", "50"], init_from="runs/base")
    out = default_run_dir(overrides={"family": "lstm"})          # runs/lstm-shakespeare

Overrides the family has no use for (``--n-head`` for an LSTM, ``--lr`` for an n-gram model) are
ignored with a warning (`warnings.warn`, one line that names them), the same one `tinylm train` prints.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tinylm.config.model import FAMILY_NAMES, NGRAM_ONLY, TRANSFORMER_ONLY, GPTConfig
from tinylm.config.tables import (Config, apply_overrides, build_config, load_config_file, load_preset,
                                  merge_tables, override_keys)
from tinylm.errors import TinyLMError

# Where a run starts when nothing names a preset: the tiny model on Shakespeare. `--model lstm`
# (or rnn) alone starts from that family's preset instead: the same data, a tuned recurrent model.
DEFAULT_PRESET = "tiny"
FAMILY_PRESETS = {"lstm": "lstm", "rnn": "rnn"}
# the file a run folder keeps its resolved configuration in (`tinylm.run.CONFIG_FILE`)
RUN_CONFIG = "config.toml"

Overrides = Sequence[str] | Mapping[str, Any]


def resolve_config(
    preset: str | None = None,
    path: str | Path | None = None,
    overrides: Overrides = (),
    *,
    init_from: str | Path | None = None,
    resume: str | Path | None = None,
) -> Config:
    """The checked `Config`: a preset, then the file at ``path``, then ``overrides``, later ones winning.

    The preset is ``preset``, else the one the file names (``preset = "small"``), else the family's
    (``overrides`` naming family lstm or rnn) or `DEFAULT_PRESET`. ``overrides`` are command-line
    style (``["--n-layer", "6", "--no-bias"]``) or a dict (``{"n_layer": 6}``), see `apply_overrides`.

    ``init_from`` (fine-tuning another run, unless a preset or file is given): the [model] table is
    that run's, the [train] settings tiny's. ``resume`` (continuing the run in that folder, unless a
    preset or file is given): every setting starts from the run's saved configuration.
    """
    mine = load_config_file(path, own_only=True) if path is not None else {}
    wanted = apply_overrides({}, overrides).get("model", {}).get("family")
    if resume is not None and not (preset or path):
        saved = Path(resume) / RUN_CONFIG
        base = load_config_file(saved) if saved.exists() else load_preset(DEFAULT_PRESET)
        theirs = base.get("model", {}).get("family", "gpt")
        if saved.exists() and wanted is not None and wanted != theirs:
            raise TinyLMError(f"{resume} is a run of {FAMILY_NAMES[theirs]} model, not {FAMILY_NAMES[wanted]} one; "
                              f"resume it with its own settings (drop --model), or start the new run in another --out")
    else:
        # fine-tuning takes tiny's [train] settings whether or not the family is named
        default = DEFAULT_PRESET if init_from else FAMILY_PRESETS.get(wanted, DEFAULT_PRESET)
        base = load_preset(preset or default) if (preset or not path) else {}
        init_config = Path(init_from or "") / RUN_CONFIG
        if init_from and not (preset or path) and init_config.is_file():
            theirs = load_config_file(init_config).get("model", {})
            family = theirs.get("family", "gpt")
            if wanted is not None and wanted != family:
                raise TinyLMError(f"--init-from {init_from} is a run of {FAMILY_NAMES[family]} model; "
                                  f"{FAMILY_NAMES[wanted]} model cannot start from its weights: drop --model, or "
                                  "train the new model from scratch")
            base = dict(base, model=theirs)
        if path is not None:
            # a file without a preset = line starts where the command does, not from the dataclass defaults
            base = merge_tables(base, load_config_file(path, default_preset=None if preset else default))
    given = apply_overrides(mine, overrides)
    config = build_config(windows_that_fit(tie_without_head_settings(apply_overrides(base, overrides), given), given))
    check_lr_alone(config, mine, overrides)
    warn_ignored(config.model.family, unused_settings(config, overrides))  # said where resolve_config is called
    return config


def check_lr_alone(config: Config, mine: Mapping[str, Mapping[str, Any]], overrides: Overrides) -> None:
    """Refuse ``lr`` set (by a flag, an override or the caller's own file) while a group that does not follow it
    keeps the preset's rate: under Muon the blocks' matrices train at ``muon_lr``, and a preset's ``head_lr`` or
    ``embed_lr`` holds the head or the embeddings at their own rate, so lowering ``lr`` alone would leave most of
    the weights where they were, which is not what "the learning rate" means to anyone coming from AdamW."""
    if config.model.family == "ngram":
        return
    given = {name for section, name in override_keys(overrides) if section == "train"}
    given |= set(mine.get("train", {}))
    if "lr" not in given:
        return
    tc = config.train
    separate = []
    if tc.optimizer == "muon":
        separate.append(("muon_lr", tc.muon_lr, "the blocks' weight matrices"))
    if tc.head_lr is not None and not getattr(config.model, "tie_embeddings", True):
        separate.append(("head_lr", tc.head_lr, "the untied head"))
    if tc.embed_lr is not None:
        separate.append(("embed_lr", tc.embed_lr, "the embeddings"))
    missing = [(name, value, what) for name, value, what in separate if name not in given]
    if not missing:
        return
    # the same words for `tinylm train` and for a Python caller: the key, then its flag
    groups = " and ".join(f"{name} {value:g} (--{name.replace('_', '-')}) for {what}" for name, value, what in missing)
    raise TinyLMError(f"lr (--lr) does not set every learning rate of this run: {groups} stay as they were; "
                      "set them too, so that every group's rate is one you chose")


def tie_without_head_settings(cfg: dict[str, dict[str, Any]], mine: Mapping[str, Mapping[str, Any]]) -> dict:
    """``cfg`` without an untied head's ``head_init_std`` when it ties the head and the caller (``mine``:
    their file's own tables and their flags) did not set ``head_init_std`` themselves: a preset's setting for
    its untied head (tiny's zero head) means nothing once the caller asks for ``tie_embeddings``. Set both,
    and `GPTConfig` says they contradict each other."""
    model = cfg.get("model", {})
    if model.get("tie_embeddings") and "head_init_std" in model and "head_init_std" not in mine.get("model", {}):
        cfg = merge_tables(cfg, {})
        del cfg["model"]["head_init_std"]
    return cfg


def windows_that_fit(cfg: dict[str, dict[str, Any]], mine: Mapping[str, Mapping[str, Any]]) -> dict:
    """``cfg`` without a preset's sequence-length schedule (``short_block_size``, tiny's 128) when it does not fit
    the block_size the caller chose (``--block-size 64``, or the [model] of a run fine-tuned with --init-from) and
    the caller (``mine``: their file's own tables and their flags) did not set ``short_block_size`` themselves:
    every step then trains at block_size. Set both, and `TrainConfig.check_windows` says why they do not fit."""
    short = cfg.get("train", {}).get("short_block_size", 0)
    if not short or "short_block_size" in mine.get("train", {}):
        return cfg
    block_size = cfg.get("model", {}).get("block_size", GPTConfig.block_size)
    if short <= block_size and block_size % short == 0:
        return cfg
    return merge_tables(cfg, {"train": {"short_block_size": 0}})


def default_run_dir(preset: str | None = None, path: str | Path | None = None, overrides: Overrides = ()) -> Path:
    """runs/<preset or config file name>-<corpus name>, e.g. runs/tiny-shakespeare (runs/lstm-shakespeare
    for family lstm, runs/small-lstm-shakespeare for preset small with family lstm)."""
    given = apply_overrides({}, overrides)
    corpus = given.get("train", {}).get("corpus")
    if corpus is None:
        corpus = load_config_file(path).get("train", {}).get("corpus") if path is not None else None
    recipe = preset or (Path(path).stem if path is not None else DEFAULT_PRESET)
    family = given.get("model", {}).get("family", "gpt")
    if family != "gpt" and recipe != family:  # runs/lstm-shakespeare beside runs/tiny-shakespeare, not on top of it
        recipe = family if not (preset or path) else f"{recipe}-{family}"
    return Path("runs") / f"{recipe}-{corpus_stem(corpus or 'shakespeare')}"


def corpus_stem(spec: str) -> str:
    """A corpus's short name for the folders made from it: ``docs`` for docs.jsonl, ``notes`` for notes/."""
    return Path(os.fspath(spec).rstrip("/\\")).stem or "corpus"


# What counting an n-gram model reads; every other setting is a network's.
_COUNTING_READS = frozenset({
    "model.family", "model.vocab_size", "model.block_size", "model.order", "model.smoothing", "model.add_k",
    "train.corpus", "train.glob", "train.text_field", "train.encoding", "train.errors", "train.tokenizer",
    "train.tokenizer_kind", "train.tokenizer_vocab_size", "train.tokenizer_pattern", "train.data_dir",
    "train.val_fraction", "train.seed", "train.sample_tokens", "train.sample_temperature", "train.sample_top_k",
    "train.device"})


def unused_settings(config: Config, overrides: Overrides) -> list[str]:
    """The flags among ``overrides`` that ``config.model.family`` has no use for, e.g. ``["--n-head"]`` for an
    LSTM: `resolve_config` warns that they are ignored (`warn_ignored`)."""
    family = config.model.family
    given = override_keys(overrides)
    unused = []
    for section, name in given:
        if family == "ngram":
            skip = f"{section}.{name}" not in _COUNTING_READS
        elif section == "model":
            skip = name in NGRAM_ONLY or (family != "gpt" and name in TRANSFORMER_ONLY)
        else:
            skip = False
        if skip:
            unused.append("--" + name.replace("_", "-"))
    if family == "ngram" and ("model", "add_k") in given and config.model.smoothing != "add-k":
        unused.append("--add-k")
    return sorted(set(unused))


def warn_ignored(family: str, flags: Sequence[str], stacklevel: int = 2) -> None:
    """One warning (`warnings.warn`, a `UserWarning`) that ``flags`` do not apply to a ``family`` model and are
    ignored, e.g. "--n-head does not apply to an LSTM model and is ignored"; none for no flags. ``stacklevel``
    as for `warnings.warn`, counted from the function that calls this one (2: that function's caller)."""
    if not flags:
        return
    one = len(flags) == 1
    warnings.warn(f"{', '.join(flags)} {'does' if one else 'do'} not apply to {FAMILY_NAMES[family]} model and "
                  f"{'is' if one else 'are'} ignored", stacklevel=stacklevel + 1)
