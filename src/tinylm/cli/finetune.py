"""`tinylm finetune`: the flags, then `tinylm.finetune.finetune`.

Which settings fine-tuning starts from, where its data goes and what it refuses are the library's
(`tinylm.finetune.recipe`); this module only hands it the flags as given.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tinylm.cli.flags import add_command, add_setting_flags, positive_float, positive_int, settings_from


def cmd_finetune(args: argparse.Namespace) -> int:
    """Teach a trained model to answer: supervised fine-tuning on conversations, the loss only on what the
    assistant writes (its messages and the end-of-turn token after each), conversations packed several to a row
    without attending to each other. --from takes a tinylm run, a checkpoint folder or a Hugging Face model folder
    (imported first). --data takes a JSONL file of
    OpenAI-style chats ({"messages": [...]}), prompt/completion pairs or Alpaca instructions
    (instruction/input/output), or built-in tasks with checkable answers: tasks:add, tasks:spell, tasks:count,
    tasks:reverse, tasks:speaker, tasks:next-line, or a mixture such as tasks:add+spell. A model made by tinylm gets
    ChatML's turn markers as special tokens and the ChatML template; an imported chat model keeps its own. The
    result is an ordinary run folder that sample, eval, serve, export and explain take. By default it trains two
    epochs (at least 250 steps) at the base run's own learning rates; the [train] flags below change that.
    --corpus instead of --data continues pretraining on text (250 steps unless a budget is given). --lora-rank R
    trains a LoRA adapter instead of every weight (--lora-alpha, --lora-dropout, --lora-targets): the run folder
    keeps the adapter, in PEFT's layout too, and points at the base it adapts. LoRA's defaults are its own: lr
    3e-3, twice the steps (it learns a new skill in more steps), and the embedding and an untied head
    corrected too (--lora-targets all,outer)."""
    settings = settings_from(args)
    data_dir = settings.pop("train.data_dir", None)
    val_fraction = settings.pop("train.val_fraction", None)
    out = args.out or str(Path("runs") / f"{Path(args.source).name}-chat") if args.source else args.out
    if out is None:
        args.parser.error("--resume needs --out, the fine-tuning run to continue")

    from tinylm.finetune import finetune  # here: torch loads only when a model trains

    result = finetune(args.source, args.data, out, val_data=args.val_data,
                      val_fraction=float(val_fraction) if val_fraction is not None else 0.05, epochs=args.epochs,
                      overrides=settings, data_dir=data_dir, resume=args.resume or False, force=args.force,
                      stop_after=args.stop_after, progress=None if args.progress else False)
    return 128 + result.stopped_by if result.stopped_by else 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    """tinylm finetune."""
    p = add_command(sub, "finetune", cmd_finetune, "teach a trained model to answer: fine-tuning on conversations",
                    allow_abbrev=False)
    p.add_argument("--from", dest="source", metavar="RUN",
                   help="the model to start from: a tinylm run, a checkpoint folder or a Hugging Face model folder")
    p.add_argument("--data", metavar="DATA", help="a JSONL file of conversations, or tasks:NAME[+NAME...]")
    p.add_argument("--val-data", metavar="FILE", help="held-out conversations (default: --val-fraction of --data "
                   "held out by the seed; built-in tasks hold out their own test items)")
    p.add_argument("--out", help="the run folder (default: runs/<the --from folder's name>-chat)")
    p.add_argument("--epochs", type=positive_float, help="the budget in passes over the training conversations "
                   "(default: 2, and at least 250 steps, unless --max-steps or --max-tokens is given)")
    p.add_argument("--resume", nargs="?", const="latest", metavar="CHECKPOINT",
                   help="continue the fine-tuning run in --out exactly where it stopped")
    p.add_argument("--force", action="store_true", help="start over in an existing run folder (deletes it)")
    p.add_argument("--stop-after", type=positive_int, metavar="STEPS",
                   help="stop after this many steps with a checkpoint, as if interrupted (resume later)")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar or progress lines")
    add_setting_flags(p, sections=("train",))
