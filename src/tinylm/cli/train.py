"""`tinylm train`: one flag per configuration field, then `resolve_config` and `tinylm.train.train`.

The setting flags are generated from the configuration dataclasses, each with the help written
beside its field. What the flags mean together (which preset a family starts from, fine-tuning
with --init-from, resuming, the run folder's name, the settings a family ignores and warns of) is
`tinylm.config.resolve_config`'s and `default_run_dir`'s: this module hands them the flags as given, so
Python gets what the command does.
"""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path

from tinylm.cli.flags import SETTING_PREFIX, OneFamily, add_command, add_setting_flags, positive_int, settings_from
from tinylm.config import FAMILY_NAMES, default_run_dir, dump_toml, load_config_file, resolve_config
from tinylm.config.resolve import warn_ignored


def cmd_train(args: argparse.Namespace) -> int:
    """Train a GPT-style Transformer by next-token cross-entropy (or, with --model, an LSTM or RNN by the same loop,
    or an n-gram model by counting). Settings come from a preset (default: tiny), then a TOML file (--config), then
    the setting flags below; the resolved configuration is saved with the run. With no arguments: the tiny model on
    Shakespeare for the preset's token budget, into runs/tiny-shakespeare. Under
    `torchrun --nproc-per-node N -m tinylm train ...` it trains with N processes (DDP, or FSDP with
    --parallel fsdp)."""
    settings = settings_from(args)
    if args.out is None:
        args.out = str(default_run_dir(args.preset, args.config, settings))
    # what resolving warns of (settings the family does not read) is printed with the run's first line, so that
    # a run refused before it starts shows its error alone
    with warnings.catch_warnings(record=True) as held:
        if args.resume and not (args.preset or args.config or settings):
            config = None  # --resume with nothing changed: the run's own configuration, as saved
        else:
            config = resolve_config(args.preset, args.config, settings, init_from=args.init_from,
                                    resume=args.out if args.resume else None)
        if config is not None and config.model.family == "ngram" and args.stop_after is not None:
            warn_ignored("ngram", ["--stop-after"])  # an argument of the loop, which counting has no steps for
    if args.print_config:
        print(dump_toml(load_config_file(Path(args.out) / "config.toml") if config is None else config.to_dict()),
              end="")
        return 0

    def log(line: str) -> None:
        while held:
            said = held.pop(0)
            warnings.showwarning(said.message, said.category, said.filename, said.lineno)
        print(line, flush=True)

    from tinylm.train import train  # here, not at the top: torch loads only when a model trains

    resume = False if args.resume is None else args.resume
    result = train(config, args.out, resume=resume, force=args.force, init_from=args.init_from,
                   stop_after=args.stop_after, progress=None if args.progress else False, log=log)
    # stopped by a signal, with a checkpoint: the exit status a process killed by it would have
    return 128 + result.stopped_by if result.stopped_by else 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    """tinylm train."""
    p = add_command(sub, "train", cmd_train, "train a model: tokenizer, data, training, checkpoints, metrics, a sample",
                    allow_abbrev=False)
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
    p.add_argument("--model", dest=f"{SETTING_PREFIX}model.family", choices=list(FAMILY_NAMES),
                   action=OneFamily, default=argparse.SUPPRESS, help="which model to train: the Transformer (gpt, "
                   "default), an LSTM or RNN by the same loop, or an n-gram model by counting (the same as --family)")
    add_setting_flags(p)
