"""`tinylm explain attention` and `tinylm explain forward`: look inside a trained Transformer.

    tinylm explain attention --run runs/tiny --text "To be, or not" --out attention.png
    tinylm explain attention --run runs/tiny --text "To be" --layer 1 --head 0 --json
    tinylm explain attention --example lecture        # the 3 x 3 worked example, no run needed
    tinylm explain forward --run runs/tiny --text "To be" --position 2
    tinylm explain forward --example lecture          # the two-token loss, 1.211 nats
    tinylm explain moe --run runs/moe --text "To be, or not" --out moe.png --tokens 8192

Added to the `explain` group (built in `tinylm.cli.explain`) by `add_model_commands`; the work is
done by `tinylm.explain.attention`, `tinylm.explain.forward` and `tinylm.explain.moe`.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tinylm.cli.flags import add_command, add_threads_flag, integer, positive_int
from tinylm.config import FAMILY_NAMES
from tinylm.errors import TinyLMError


def _check_run_and_text(args: argparse.Namespace) -> None:
    if args.example is not None:
        if args.run or args.text is not None:
            raise TinyLMError("--example lecture needs no --run or --text: it shows its own numbers")
        return
    if not args.run or args.text is None:
        raise TinyLMError(f"give a run and a text: tinylm explain {args.explain_command} --run DIR --text TEXT "
                          "(or --example lecture)")


def _run_unless_example(args: argparse.Namespace, example: Callable[[], Any], describe: Callable[[Any], str]):
    """The run ``--run`` names; or, with ``--example``, None once the worked example is printed (one JSON line
    with ``--json``): both commands take a run and a text, or show their own numbers instead."""
    _check_run_and_text(args)
    if args.example is not None:
        shown = example()
        print(json.dumps(shown.report()) if args.json else describe(shown))
        return None
    from tinylm.run import load_run

    return load_run(args.run, checkpoint=args.checkpoint)


def cmd_attention(args: argparse.Namespace) -> int:
    """Run a text (after the run's start token) through a trained Transformer and draw every layer's and head's
    attention weights as heatmaps, tokens on the axes: row i is how position i spreads its attention over positions
    0..i; the future above the diagonal, hidden by the -inf mask, is left blank. --example lecture instead computes
    a worked 3 x 3 example (T = 3, d_h = 2, c = 1) with tinylm's reference attention and prints the weights and the
    output."""
    from tinylm.explain.attention import attention_of_text, format_example, plot_attention, worked_example

    run = _run_unless_example(args, worked_example, format_example)
    if run is None:
        return 0
    from tinylm.cli.flags import command_threads

    with command_threads(args):
        maps = attention_of_text(run.model, run.tokenizer, args.text, start_ids=run.start_ids, layer=args.layer,
                                 head=args.head)
    out = Path(args.out) if args.out else Path(run.path) / "attention.png"
    plot_attention(maps, out, title=f"{Path(run.path).name}: attention weights (row: query, column: key)")
    if args.json:
        print(json.dumps({"run": str(args.run), "picture": str(out), **maps.report()}))
        return 0
    print(f"{len(maps.tokens)} tokens: {' | '.join(maps.tokens)}")
    print(f"{len(maps.layers) * len(maps.head_numbers)} panels (layers {maps.layer_numbers}, heads "
          f"{maps.head_numbers}); the masked future, above each diagonal, is left blank")
    print(f"picture: {out}")
    return 0


def cmd_forward(args: argparse.Namespace) -> int:
    """Run a text through a trained Transformer once and print every step in row-vector notation (x, h = E[x],
    q = h W^Q, k, v, the scores, the mask row, the softmax, the attention output, the residual adds, the norms, the
    logits, the loss), each with its shape and its values at one position. The values are recorded from the model's
    own modules while it runs, so the logits are the model's. --example lecture instead works out the loss of two
    tokens over a vocabulary of 3 (1.211 nats)."""
    from tinylm.explain.attention import text_ids
    from tinylm.explain.forward import format_trace, format_two_token_loss, trace_forward, two_token_loss

    run = _run_unless_example(args, two_token_loss, format_two_token_loss)
    if run is None:
        return 0
    from tinylm.cli.flags import command_threads

    if run.family != "gpt":
        raise TinyLMError(f"{args.run} holds {FAMILY_NAMES.get(run.family, run.family)} model; `explain forward` "
                          "traces a Transformer's forward pass")
    with command_threads(args):
        ids = text_ids(run.model, run.tokenizer, args.text, start_ids=run.start_ids)
        trace = trace_forward(run.model, ids, position=args.position, head=args.head)
    print(json.dumps({"run": str(args.run), **trace.report()}) if args.json else format_trace(trace))
    return 0


def cmd_moe(args: argparse.Namespace) -> int:
    """Show how a Mixture-of-Experts Transformer routes its tokens. For the text (after the run's start token):
    the experts each token went to in each layer, with their gate weights, largest first, as a table and as a grid
    of tokens by layers coloured by the top-1 expert. Over --tokens tokens of the run's --split: the share of the
    token-slots each expert got in each layer, against the even share 1/E, and the coefficient of variation of those
    loads (std / mean; 0 is even). Both go into one PNG (default: moe.png in the run folder)."""
    from tinylm.explain.moe import expert_load, format_load, format_routing, moe_layers, plot_moe, routing_of_text, \
        split_tokens
    from tinylm.run import load_run

    if not args.run or args.text is None:
        raise TinyLMError("give a run and a text: tinylm explain moe --run DIR --text TEXT")
    run = load_run(args.run, checkpoint=args.checkpoint)
    moe_layers(run.model)  # a dense run, or another family, is refused before any data is read
    tokens = split_tokens(run, args.split, args.data_dir)
    from tinylm.cli.flags import command_threads

    with command_threads(args):
        routing = routing_of_text(run.model, run.tokenizer, args.text, start_ids=run.start_ids)
        load = expert_load(run.model, tokens, n_tokens=args.tokens)
    out = Path(args.out) if args.out else Path(run.path) / "moe.png"
    plot_moe(routing, load, out, title=f"{Path(run.path).name}: the experts of each token, and the loads on the "
             f"{args.split} split")
    if args.json:
        print(json.dumps({"run": str(args.run), "picture": str(out), "routing": routing.report(),
                          "load": {"split": args.split, **load.report()}}))
        return 0
    print(format_routing(routing))
    print()
    print(f"on the {args.split} split: " + format_load(load))
    print(f"picture: {out}")
    return 0


def add_model_commands(subparsers: argparse._SubParsersAction) -> None:
    """tinylm explain attention, tinylm explain forward and tinylm explain moe."""
    p = add_command(subparsers, "attention", cmd_attention,
                    "heatmaps of a Transformer's masked attention weights on a text")
    _run_and_text(p)
    p.add_argument("--layer", type=integer, metavar="L", help="only this layer (0-based; default: all)")
    p.add_argument("--head", type=integer, metavar="H", help="only this head (0-based; default: all)")
    p.add_argument("--out", metavar="PNG", help="where to write the picture (default: attention.png in the run folder)")
    _common(p)
    p.set_defaults(explain_command="attention")

    p = add_command(subparsers, "forward", cmd_forward,
                    "one forward pass step by step: embeddings, q = h W^Q, scores, mask, softmax, ..., loss")
    _run_and_text(p)
    p.add_argument("--position", type=integer, metavar="T", help="the position whose values to show (default: the last)")
    p.add_argument("--head", type=integer, default=0, metavar="H", help="the head whose scores and softmax to show "
                   "(default: 0)")
    _common(p)
    p.set_defaults(explain_command="forward")

    p = add_command(subparsers, "moe", cmd_moe,
                    "a Mixture-of-Experts model's routing: each token's experts by layer, and the experts' loads")
    _run_and_text(p)
    p.add_argument("--split", choices=["train", "val"], default="val",
                   help="the split of the run's shards whose load to count (default: val)")
    p.add_argument("--tokens", type=positive_int, default=8192, metavar="N",
                   help="tokens of the split to route for the load (default: 8192; all of it when shorter)")
    p.add_argument("--data-dir", metavar="DIR", help="the run's shard folder, if it has moved")
    p.add_argument("--out", metavar="PNG", help="where to write the picture (default: moe.png in the run folder)")
    p.add_argument("--checkpoint", choices=["best", "latest"], default="best", help="which checkpoint (default: best)")
    p.add_argument("--json", action="store_true", help="print the routing and the loads as one JSON object")
    add_threads_flag(p)
    p.set_defaults(explain_command="moe")


def _run_and_text(p: argparse.ArgumentParser) -> None:
    """What both commands read (or --example instead: `_check_run_and_text`)."""
    p.add_argument("--run", metavar="DIR", help="the run folder written by `tinylm train`")
    p.add_argument("--text", help="the text to read")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", choices=["best", "latest"], default="best", help="which checkpoint (default: best)")
    p.add_argument("--json", action="store_true", help="print the numbers as one JSON object")
    p.add_argument("--example", choices=["lecture"], help="the worked example instead of a run")
    add_threads_flag(p)
