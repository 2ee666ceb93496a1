"""The `tinylm` command: thin argparse subcommands over the library.

Each subcommand parses its flags and calls one library function; everything it does can be
done from Python too. A user mistake raises `TinyLMError`, which is printed as one line on
stderr with exit status 2 and no traceback; so is a bad flag value.

    tinylm tokenizer train --corpus shakespeare --kind bpe --vocab-size 4096 --out tok.json
    tinylm tokenizer encode --tokenizer tok.json --text "To be, or not to be" --show
    tinylm tokenizer info --tokenizer tok.json
    tinylm prepare --corpus shakespeare --out data/shakespeare
    tinylm train                                   # the tiny preset on Shakespeare, into runs/tiny-shakespeare
    tinylm train --preset tiny --max-steps 100 --out runs/quick
    tinylm eval runs/quick
    tinylm eval runs/quick --stride 64             # sliding windows: more context for every target

The commands are grouped by the part of the library they call, one module each: `tokenizer`,
`data` (prepare), `train`, `evaluate` (eval, compare), `generate` (sample, next-token), `serve`, `export`
(export, import) and `explain` (tokens, sampling, cost, attention, forward); each has an `add_commands` that
adds its subcommands to the parser, and
`flags` holds what they share. A command is declared by `flags.add_command`, with its one-line summary; the
description its --help prints is its function's docstring. A command imports the library it calls when it runs,
so that `tinylm --help` answers without loading torch.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import os
import signal
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence

from tinylm import __version__
from tinylm.atomic import disk_failure
from tinylm.cli import chat, data, evaluate, explain, export, finetune, generate, serve, tokenizer, train
from tinylm.cli.flags import Parser, show_help
from tinylm.errors import Stopped, TinyLMError


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="tinylm",
        description="Autoregressive Transformer language models end to end: tokenize, prepare data, "
        "train, evaluate and compare, sample, serve, export and import, explain.",
    )
    parser.add_argument("--version", action="version", version=f"tinylm {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    # the order of `tinylm --help`
    for commands in (tokenizer, data, train, finetune, evaluate, generate, chat, serve, export, explain):
        commands.add_commands(sub)
    return parser


def _closest_flag(command: argparse.ArgumentParser, extra: Sequence[str]) -> str:
    """`` (did you mean '--max-steps'?)`` for the first unknown flag in ``extra`` close to one of ``command``'s
    (a typo, or a flag abbreviated where abbreviations are off); "" when none is close."""
    flags = [flag for flag in command._option_string_actions if flag.startswith("--")]
    for word in extra:
        if word.startswith("--"):
            # closer than difflib's default: flags share "--" and dashes, so a loose match guesses wrong
            close = difflib.get_close_matches(word.split("=", 1)[0], flags, n=1, cutoff=0.8)
            if close:
                return f" (did you mean {close[0]!r}?)"
    return ""


def _one_line_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """Warnings meant for the user (a sample outgrowing the context, ...) as one line, like errors."""
    print(f"tinylm: warning: {message}", file=sys.stderr if file is None else file)


@contextlib.contextmanager
def _sigterm_unwinds() -> Iterator[None]:
    """SIGTERM unwinds like Ctrl-C (locks released, temporary files removed) instead of killing the process where
    it stands; the handler before is back when the command returns. Worker processes forked from this one die
    at SIGTERM as usual."""
    main_pid = os.getpid()

    def handle(signum, frame):
        if os.getpid() != main_pid:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        raise Stopped(signum)

    try:
        before = signal.signal(signal.SIGTERM, handle)
    except ValueError:  # not the main thread (main() called from a thread): SIGTERM stays as it is
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before if before is not None else signal.SIG_DFL)


def main(argv: Sequence[str] | None = None) -> int:
    warnings.showwarning = _one_line_warning
    with _sigterm_unwinds():
        return _run(argv)


def _run(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # said by the subcommand's parser, so the hint is `tinylm train --help`, not `tinylm --help`
        command = getattr(args, "parser", parser)
        command.error(f"unrecognized arguments: {' '.join(extra)}{_closest_flag(command, extra)}")
    func: Callable[[argparse.Namespace], int] = getattr(args, "func", show_help(parser))
    try:
        return func(args)
    except TinyLMError as e:
        print(f"tinylm: error: {e}", file=sys.stderr)
        return 2
    except Stopped as e:
        print(f"tinylm: stopped by {signal.Signals(e.signum).name}", file=sys.stderr)
        return 128 + e.signum
    except KeyboardInterrupt:
        print("tinylm: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `tinylm tokenizer encode ... | head`
        sys.stderr.close()
        return 0
    except OSError as e:
        # a full or read-only disk met by a write that `tinylm.atomic.disk_writes` does not wrap: still one
        # line (the wrapped ones say what is intact, too)
        failure = disk_failure(e)
        if failure is None:
            raise
        what = f"cannot write {e.filename}" if e.filename else "a write failed"  # os.write names no file
        print(f"tinylm: error: {what}: {failure[0]}; {failure[1]} and try again", file=sys.stderr)
        return 2
