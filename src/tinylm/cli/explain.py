"""`tinylm explain`: the lectures' pictures and worked numbers, for any tokenizer, run or configuration.

    tinylm explain tokens --tokenizer tok.json --text "To be, or not to be" --merges --out tokens.png
    tinylm explain sampling --logits 2,1,-1 --temperatures 1,2,0.01
    tinylm explain sampling --run runs/tiny-shakespeare --text "ROMEO:" --top-k 5 --top-p 0.9 --out sampling.png
    tinylm explain cost --n-layer 1 --d-model 512 --n-head 8
    tinylm explain cost --preset gpt2-124m --lora-rank 8 --batch 4 --context 256
    tinylm explain attention ... / forward ... / moe ...   (cli/explain_model.py)

Each command is a thin call into `tinylm.explain` (tokens, sampling, cost); --json prints the table
as one JSON object, --out draws the picture as a PNG.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

from tinylm.cli.explain_model import add_model_commands
from tinylm.cli.flags import (SETTING_PREFIX, Parser, add_command, add_setting_flags, add_threads_flag, positive_int,
                              probability, settings_from, show_help)
from tinylm.errors import TinyLMError


def _tokenizer_from(args: argparse.Namespace):
    from tinylm.tokenizers import load_tokenizer

    if (args.tokenizer is None) == (args.run is None):
        raise TinyLMError("give the tokenizer with --tokenizer FILE or a run's with --run DIR (one of them)")
    if args.tokenizer is not None:
        return load_tokenizer(args.tokenizer)
    from tinylm.run import TOKENIZER_FILE, check_run_dir

    return load_tokenizer(check_run_dir(args.run) / TOKENIZER_FILE)


def _show(args: argparse.Namespace, report: Callable[[], dict], text: Callable[[], str], picture) -> int:
    """What every explain command prints: with --json one JSON line (the picture's path in it), else the
    table and then where the picture is."""
    if args.json:
        print(json.dumps({**report(), "picture": picture and str(picture)}))
        return 0
    print(text())
    if picture:
        print(f"picture: {picture}")
    return 0


def cmd_tokens(args: argparse.Namespace) -> int:
    """Split a text with a tokenizer (char, word, BPE or imported) and show each piece with its id and byte count,
    as a table and, with --out, coloured boxes in a PNG."""
    from tinylm.explain.tokens import format_pieces, plot_pieces, token_pieces

    pieces = token_pieces(_tokenizer_from(args), args.text, merges=args.merges)
    picture = plot_pieces(pieces, args.out) if args.out else None
    return _show(args, lambda: {"pieces": [p.to_json() for p in pieces]}, lambda: format_pieces(pieces), picture)


def _numbers(text: str, flag: str) -> list[float]:
    try:
        values = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise TinyLMError(f"{flag} expects numbers separated by commas, e.g. 2,1,-1; got {text!r}") from None
    if not values:
        raise TinyLMError(f"{flag} expects numbers separated by commas, e.g. 2,1,-1; got {text!r}")
    return values


def cmd_sampling(args: argparse.Namespace) -> int:
    """Show how temperature, then top-k, then top-p reshape a next-token distribution (the filters every tinylm
    sampler uses), for a run's next token after --text or for logits given with --logits (no model needed)."""
    from tinylm.explain.sampling import explain_logits, explain_run, format_sampling, plot_sampling
    from tinylm.cli.flags import parse_temperatures

    temps = parse_temperatures(args.temperatures)
    if args.logits is not None:
        if args.run is not None:
            raise TinyLMError("give --logits (no model needed) or --run with --text, not both")
        table = explain_logits(_numbers(args.logits, "--logits"), temps, args.top_k, args.top_p)
    else:
        if args.run is None:
            raise TinyLMError("give --run DIR and --text TEXT for a model's next token, or --logits 2,1,-1")
        from tinylm.cli.flags import command_threads
        from tinylm.run import load_run

        run = load_run(args.run)
        with command_threads(args):
            table = explain_run(run, args.text or "", temps, args.top_k, args.top_p, args.top)
    picture = plot_sampling(table, args.out) if args.out else None
    return _show(args, table.to_json, lambda: format_sampling(table), picture)


def cmd_cost(args: argparse.Namespace) -> int:
    """Account for a model without building it: parameters per component (tied weights once), FLOPs per token
    (exact, and the 6N + attention rule), KV-cache bytes, activation memory for a batch, and (--out) a plot of cost
    against the context length. The model is a run's, or a preset, TOML file and setting flags as for
    `tinylm train`. With --lora-rank (or a LoRA run's own settings) it also sets a LoRA step's memory beside
    full fine-tuning's."""
    from tinylm.explain.cost import cost_report, format_cost, plot_cost
    from tinylm.model.lora import LoraSettings

    config = _cost_config(args)
    lora = LoraSettings.of(config.train)
    report = cost_report(config.model, batch_size=args.batch or config.train.batch_size, seq_len=args.context,
                         lora=lora, optimizer=config.train.optimizer)
    picture = plot_cost(config.model, args.out) if args.out else None
    return _show(args, lambda: report, lambda: format_cost(report), picture)


def _cost_config(args: argparse.Namespace):
    """The configuration `tinylm explain cost` accounts for: a run's own (its LoRA settings may be given), or a
    preset's and TOML file's with the setting flags over them."""
    from tinylm.config import apply_overrides, build_config, load_config_file, resolve_config

    settings = settings_from(args)
    if args.run is None:
        return resolve_config(args.preset, args.config, settings)
    lora = {key: value for key, value in settings.items() if key.startswith("train.lora_")}
    if args.preset or args.config or len(lora) < len(settings):
        raise TinyLMError("--run explains the run's own configuration; leave out --preset, --config and settings "
                          "(the --lora-* flags may be given)")
    from tinylm.run import CONFIG_FILE, check_run_dir

    path = check_run_dir(args.run) / CONFIG_FILE
    if not path.is_file():
        raise TinyLMError(f"{args.run} has no {CONFIG_FILE}; give the folder `tinylm train` wrote")
    return build_config(apply_overrides(load_config_file(path), lora))


def _add_lora_flags(p: argparse.ArgumentParser) -> None:
    """--lora-rank, --lora-alpha, --lora-dropout, --lora-targets: training's [train] settings of those names."""
    import dataclasses

    from tinylm.config import TrainConfig

    group = p.add_argument_group("LoRA", "set a LoRA step's memory beside full fine-tuning's (as `tinylm train` "
                                 "and `tinylm finetune` take these settings)")
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    for name, metavar in (("lora_rank", "R"), ("lora_alpha", "X"), ("lora_dropout", "P"), ("lora_targets", "TEXT")):
        group.add_argument("--" + name.replace("_", "-"), dest=f"{SETTING_PREFIX}train.{name}", metavar=metavar,
                           default=argparse.SUPPRESS, help=fields[name].metadata["help"].replace("%", "%%"))


def add_commands(sub: argparse._SubParsersAction) -> None:
    """tinylm explain and its subcommands."""
    group = sub.add_parser("explain", help="pictures and worked numbers: tokens, sampling, cost, attention, forward, moe",
                           description="Explain a tokenizer, a model or a configuration the way the lectures do: "
                           "tables on the terminal (--json for scripts) and pictures as PNG files (--out).")
    group.set_defaults(func=show_help(group), parser=group)
    explain = group.add_subparsers(dest="explain_command", metavar="WHAT", parser_class=Parser)

    p = add_command(explain, "tokens", cmd_tokens,
                    "how a text splits into tokens: pieces, ids, bytes (and BPE merges)")
    p.add_argument("--tokenizer", metavar="FILE", help="a tokenizer JSON file (tinylm tokenizer train --out)")
    p.add_argument("--run", metavar="DIR", help="or a run folder: its tokenizer")
    p.add_argument("--text", required=True, help="the text to split")
    p.add_argument("--merges", action="store_true", help="BPE: the ranks of the merges that built each piece")
    p.add_argument("--out", metavar="PNG", help="draw the pieces into this PNG file")
    p.add_argument("--json", action="store_true", help="print the pieces as one JSON object")

    p = add_command(explain, "sampling", cmd_sampling,
                    "the next-token distribution before and after temperature, top-k, top-p")
    p.add_argument("--run", metavar="DIR", help="the run folder whose next token to explain")
    p.add_argument("--text", help="the text before the next token (with --run)")
    p.add_argument("--logits", metavar="U1,U2,...", help="explain these logits instead of a model's, e.g. 2,1,-1")
    p.add_argument("--temperatures", default="0.5,1,2", help="temperatures, comma-separated (default: 0.5,1,2; "
                   "0 is greedy)")
    p.add_argument("--top-k", type=positive_int, metavar="K", help="keep the K most likely tokens (default: off)")
    p.add_argument("--top-p", type=probability, metavar="P", help="keep the nucleus of mass P (default: off)")
    p.add_argument("--top", type=positive_int, default=10, help="with --run: tokens to show (default: 10)")
    p.add_argument("--out", metavar="PNG", help="draw one panel per temperature into this PNG file")
    p.add_argument("--json", action="store_true", help="print the table as one JSON object")
    add_threads_flag(p)

    p = add_command(explain, "cost", cmd_cost,
                    "parameters, FLOPs, KV cache and activation memory of a configuration", allow_abbrev=False)
    p.add_argument("--run", metavar="DIR", help="a run folder: its configuration")
    p.add_argument("--preset", help="start from a named preset (default: tiny, unless --config names one)")
    p.add_argument("--config", help="a TOML file with [model] and [train] tables")
    p.add_argument("--context", type=positive_int, metavar="T", help="context length T (default: block_size)")
    p.add_argument("--batch", type=positive_int, metavar="B", help="sequences per batch for the activation memory "
                   "(default: the configuration's batch_size)")
    p.add_argument("--out", metavar="PNG", help="plot parameters, FLOPs and inner products against T into this PNG")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    add_setting_flags(p, sections=("model",))  # the cost of a model; of training's settings --batch and LoRA's
    _add_lora_flags(p)

    add_model_commands(explain)  # tinylm explain attention, forward, moe
