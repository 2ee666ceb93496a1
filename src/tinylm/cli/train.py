"""`tinylm train`: one flag per configuration field, then `resolve_config` and `tinylm.train.train`.

The setting flags are generated from the configuration dataclasses, each with the help written
beside its field. What the flags mean together (which preset a family starts from, fine-tuning
with --init-from, resuming, the run folder's name) is `tinylm.config.resolve_config`'s and
`default_run_dir`'s: this module hands them the flags as given, so Python gets what the command does.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing
from pathlib import Path

from tinylm.cli.flags import positive_int
from tinylm.config import (DEFAULT_PRESET, FAMILY_NAMES, SECTIONS, default_run_dir, dump_toml, field_types,
                           load_config_file, resolve_config, unused_settings)
from tinylm.config.fields import optional_inner

_SETTING_PREFIX = "setting:"  # argparse dest of a [model]/[train] setting: "setting:<table>.<key>"


def cmd_train(args: argparse.Namespace) -> int:
    settings = _settings(args)
    if args.out is None:
        args.out = str(default_run_dir(args.preset, args.config, settings))
    if args.resume and not (args.preset or args.config or settings):
        config = None  # --resume with nothing changed: the run's own configuration, as saved
    else:
        config = resolve_config(args.preset, args.config, settings, init_from=args.init_from,
                                resume=args.out if args.resume else None)
    if args.print_config:
        print(dump_toml(load_config_file(Path(args.out) / "config.toml") if config is None else config.to_dict()),
              end="")
        return 0
    unused = unused_settings(config, settings) if config is not None else []
    if config is not None and config.model.family == "ngram" and args.stop_after is not None:
        unused = sorted([*unused, "--stop-after"])  # a flag of the loop, which counting has no steps for
    pending = []
    if unused:
        pending.append(f"tinylm: warning: {', '.join(unused)} {'does' if len(unused) == 1 else 'do'} not apply to "
                       f"{FAMILY_NAMES[config.model.family]} model and {'is' if len(unused) == 1 else 'are'} ignored")

    def log(line: str) -> None:
        # the warning goes out with the run's first line: a run refused before it starts shows its error alone
        while pending:
            print(pending.pop(0), file=sys.stderr, flush=True)
        print(line, flush=True)

    from tinylm.train import train  # here, not at the top: torch loads only when a model trains

    resume = False if args.resume is None else args.resume
    train(config, args.out, resume=resume, force=args.force, init_from=args.init_from,
          stop_after=args.stop_after, progress=None if args.progress else False, log=log)
    return 0


def _settings(args: argparse.Namespace) -> dict[str, object]:
    """The setting flags given on the command line, ``{"model.n_layer": "6", ...}``, values as typed."""
    return {k[len(_SETTING_PREFIX):]: v for k, v in vars(args).items() if k.startswith(_SETTING_PREFIX)}


def add_commands(sub: argparse._SubParsersAction) -> None:
    """tinylm train."""
    # tinylm train
    p = sub.add_parser(
        "train", help="train a model: tokenizer, data, training, checkpoints, metrics, a sample",
        allow_abbrev=False,
        description="Train a GPT-style Transformer by next-token cross-entropy (or, with --model, an LSTM or RNN "
        "by the same loop, or an n-gram model by counting). Settings come from a preset "
        "(default: tiny), then a TOML file (--config), then the setting flags below; the resolved "
        "configuration is saved with the run. With no arguments: the tiny model on Shakespeare for the "
        "preset's token budget, into runs/tiny-shakespeare. Under `torchrun --nproc-per-node N -m tinylm "
        "train ...` it trains with N processes (DDP, or FSDP with --parallel fsdp).",
    )
    p.add_argument("--preset", help="start from a named preset (default: tiny, unless --config names one)")
    p.add_argument("--config", help="a TOML file with [model] and [train] tables (and an optional preset = \"name\")")
    p.add_argument("--out", help="the run folder (default: runs/<preset>-<corpus>)")
    p.add_argument("--resume", nargs="?", const="latest", metavar="CHECKPOINT",
                   help="continue the run in --out exactly where it stopped: from its latest checkpoint, or "
                   "'best', or a checkpoint folder; with a larger --max-steps or --max-tokens, extend a run (it "
                   "says what that does to the learning-rate schedule)")
    p.add_argument("--force", action="store_true", help="start over in an existing run folder (deletes it)")
    p.add_argument("--init-from", metavar="RUN", help="start from another run's weights (its best checkpoint) or a "
                   "checkpoint folder, with a fresh optimizer: fine-tuning")
    p.add_argument("--stop-after", type=positive_int, metavar="STEPS",
                   help="stop after this many steps with a checkpoint, as if interrupted (resume later)")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress bar or progress lines")
    p.add_argument("--print-config", action="store_true",
                   help="print the resolved configuration as TOML and exit: nothing is trained or written")
    p.add_argument("--model", dest=f"{_SETTING_PREFIX}model.family", choices=list(FAMILY_NAMES),
                   action=_OneFamily, default=argparse.SUPPRESS, help="which model to train: the Transformer (gpt, "
                   "default), an LSTM or RNN by the same loop, or an n-gram model by counting (the same as --family)")
    _add_setting_flags(p)
    p.set_defaults(func=cmd_train, parser=p)


def _add_setting_flags(p: argparse.ArgumentParser) -> None:
    """One flag per configuration field, [model] and [train], generated from the dataclasses.

    Values stay text here; `apply_overrides` parses and checks them, so a flag and a TOML key
    give the same errors. Only the flags given on the command line end up in the namespace.
    The defaults shown are the tiny preset's, which is where `tinylm train` starts.
    """
    tiny = resolve_config(preset=DEFAULT_PRESET)
    for section, cls in SECTIONS.items():
        group = p.add_argument_group(
            f"[{section}] settings",
            "override the preset and --config file, e.g. --n-layer 6" if section == "model"
            else "override the preset and --config file, e.g. --lr 2e-3 --max-steps 500",
        )
        types = field_types(cls)
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            dest = f"{_SETTING_PREFIX}{section}.{f.name}"
            help_text = f.metadata["help"]
            default = getattr(getattr(tiny, section), f.name)
            if types[f.name] is bool:
                group.add_argument(flag, dest=dest, action="store_const", const=True, default=argparse.SUPPRESS,
                                   help=f"{help_text}; --no-{flag[2:]} to turn off (tiny: {str(default).lower()})")
                group.add_argument("--no-" + flag[2:], dest=dest, action="store_const", const=False,
                                   default=argparse.SUPPRESS, help=argparse.SUPPRESS)
                continue
            tp = optional_inner(types[f.name])
            if typing.get_origin(tp) is typing.Literal:
                metavar = "{" + ",".join(typing.get_args(tp)) + "}"
            else:
                metavar = {int: "N", float: "X"}.get(tp, "TEXT")
            shown = "unset" if default is None else default
            group.add_argument(flag, dest=dest, metavar=metavar, default=argparse.SUPPRESS,
                               action=_OneFamily if f.name == "family" else "store",
                               help=f"{help_text} (tiny: {shown})".replace("%", "%%"))


class _OneFamily(argparse.Action):
    """--model and --family are one setting: given both, they must agree (otherwise the last would win unseen)."""

    def __call__(self, parser, namespace, values, option_string=None):
        before = getattr(namespace, self.dest, None)
        if before is not None and before != values:
            parser.error(f"{option_string} {values} contradicts the family given before ({before}); "
                         "give --model (or --family) once")
        setattr(namespace, self.dest, values)
