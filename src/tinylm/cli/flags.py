"""What the subcommands share: the one-line-error parser, how a command is declared (`add_command`), flag types,
the corpus, tokenizer and input flags, and the setting flags generated from the configuration dataclasses
(`tinylm train`, `tinylm explain cost`).

A command module builds its parser from these (`add_corpus_flags(p)`) and reads the flags back
with their partners (`load_corpus_from(args)`), so every command spells a corpus the same way.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import inspect
import sys
import typing
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from tinylm.config import DEFAULT_PRESET, SECTIONS, field_types, resolve_config
from tinylm.config.fields import optional_inner
from tinylm.errors import TinyLMError

if TYPE_CHECKING:
    from tinylm.device import ThreadChoice


class Parser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line ("what is wrong; see --help"), exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def _number(kind: type, what: str, ok: Callable[[float], bool]) -> Callable[[str], float]:
    """An argparse type: parse ``kind`` from the flag's text and check it, naming ``what`` was expected."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
        return value

    return parse


positive_int = _number(int, "a positive integer", lambda v: v >= 1)
seed_int = _number(int, "an integer from 0 to 2**63 - 1", lambda v: 0 <= v < 2**63)
integer = _number(int, "an integer", lambda v: True)  # a range the library checks (it knows the bounds)
nonneg_float = _number(float, "a number >= 0", lambda v: v >= 0)
positive_float = _number(float, "a number > 0", lambda v: v > 0 and v != float("inf"))
probability = _number(float, "a number between 0 and 1", lambda v: 0.0 <= v <= 1.0)
fraction = _number(float, "a number strictly between 0 and 1", lambda v: 0.0 < v < 1.0)
port = _number(int, "a port number from 0 (any free port) to 65535", lambda v: 0 <= v <= 65535)


SETTING_PREFIX = "setting:"  # argparse dest of a [model]/[train] setting: "setting:<table>.<key>"


def add_threads_flag(p: argparse.ArgumentParser) -> None:
    """--threads, the same on every command that runs a model (`tinylm.device.use_threads` is the default)."""
    p.add_argument("--threads", type=positive_int, metavar="N",
                   help="PyTorch CPU threads (default: one per core not busy now; the busy ones are left out and "
                   "named in one line)")


def command_threads(args: argparse.Namespace) -> contextlib.AbstractContextManager[ThreadChoice]:
    """A command's CPU threads: ``args.threads`` (--threads) or the busy-core rule of `tinylm.device.use_threads`,
    said in one line on stderr (stdout keeps the text alone)."""
    from tinylm.device import use_threads  # torch: only when a command runs

    return use_threads(getattr(args, "device", "cpu"), getattr(args, "threads", None),
                       log=lambda line: print(f"tinylm: {line}", file=sys.stderr))


RUN_HELP = "the run folder written by `tinylm train`"


def add_run_flags(p: argparse.ArgumentParser, help: str = RUN_HELP, *, dest: str = "run", required: bool = True,
                  checkpoint: bool = True) -> None:
    """--run DIR, the trained run a command loads, and beside it (``checkpoint``) --checkpoint best|latest, which
    of its checkpoints (`tinylm.run.load_run`'s ``checkpoint``; default best): spelled alike by every command
    that loads a run. ``help`` says what --run may name; ``dest`` and ``required`` are argparse's, for a command
    that also takes the run bare (`tinylm eval RUN`)."""
    p.add_argument("--run", dest=dest, required=required, metavar="DIR", help=help)
    if checkpoint:
        p.add_argument("--checkpoint", choices=["best", "latest"], default="best",
                       help="which checkpoint (default: best)")


def parse_temperatures(text: str) -> list[float]:
    """'0.5,1,2' -> [0.5, 1.0, 2.0]; each 0 or more."""
    try:
        values = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise TinyLMError(f"--temperatures expects numbers separated by commas, e.g. 0.5,1,2; got {text!r}") from None
    if not values or any(v < 0 for v in values):
        raise TinyLMError(f"--temperatures expects numbers >= 0 separated by commas, got {text!r}")
    return values


def add_corpus_flags(p: argparse.ArgumentParser, default: str | None = "shakespeare", what: str = "") -> None:
    from tinylm.data.corpora import CORPORA

    p.add_argument(
        "--corpus",
        default=default,
        help=f"{what + ' ' if what else ''}a built-in corpus ({', '.join(CORPORA)}) or a path to a text file, a "
        "folder of text files, or a .jsonl file" + (f" (default: {default})" if default else ""),
    )
    p.add_argument("--glob", help="for a folder: which files to read, e.g. '**/*.md' (default: **/*.txt)")
    p.add_argument("--text-field", default="text", help="for JSONL: the field that holds the text (default: text)")
    p.add_argument(
        "--encoding",
        default="utf-8",
        help="the text encoding of a local corpus's files, any Python codec name: latin-1, cp1252 (Windows), "
        "utf-16, ... (default: utf-8; the built-in corpora are UTF-8)",
    )
    p.add_argument(
        "--errors",
        choices=["strict", "replace", "ignore"],
        default="strict",
        help="what to do with bytes that are not valid in the encoding: stop with an error naming the file "
        "and offset (strict, the default), replace them with U+FFFD, or drop them",
    )


def load_corpus_from(args: argparse.Namespace):
    """The corpus the corpus flags name, or None where --corpus is optional and not given."""
    from tinylm.data.corpora import load_corpus

    if args.corpus is None:
        if args.glob is not None or args.text_field != "text" or args.errors != "strict" or args.encoding != "utf-8":
            raise TinyLMError(
                "--glob, --text-field, --encoding and --errors say how to read --corpus; give --corpus too")
        return None
    return load_corpus(args.corpus, glob=args.glob, text_field=args.text_field, errors=args.errors,
                       encoding=args.encoding)


def add_tokenizer_training_flags(p: argparse.ArgumentParser, vocab_default: int) -> None:
    from tinylm.tokenizers import PATTERNS

    p.add_argument("--kind", choices=["bpe", "char", "word"], default="bpe", help="tokenizer kind (default: bpe)")
    p.add_argument(
        "--vocab-size",
        type=positive_int,
        default=vocab_default,
        help=f"|V| including special tokens, for bpe and word (default: {vocab_default}); char "
        "tokenizers take every character of the corpus",
    )
    p.add_argument(
        "--pattern",
        default="gpt4",
        help=f"bpe pre-tokenization split: {', '.join(PATTERNS)}, or a regex of your own (default: gpt4)",
    )
    p.add_argument("--reserved", type=int, default=0, help="extra reserved special tokens after bos, eos, pad (default: 0)")
    p.add_argument(
        "--unknown",
        choices=["unk", "bytes"],
        default="unk",
        help="char and word tokenizers: unseen input becomes <unk> (default) or its UTF-8 bytes",
    )
    p.add_argument("--workers", type=positive_int, help="processes for counting and encoding (default: all cores)")


def train_tokenizer_from(args: argparse.Namespace, corpus):
    from tinylm.tokenizers import train_tokenizer

    return train_tokenizer(args.kind, corpus.texts(), vocab_size=args.vocab_size, pattern=args.pattern,
                           unknown=args.unknown, n_reserved=args.reserved, workers=args.workers,
                           progress=sys.stderr.isatty())


def read_input(args: argparse.Namespace) -> str:
    if args.text is not None:
        return args.text
    if args.file is not None:
        path = Path(args.file)
        if not path.is_file():
            raise TinyLMError(f"input file {path} does not exist; check the path")
        try:
            return path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise TinyLMError(f"{path} is not valid UTF-8 (byte offset {e.start}); convert it to UTF-8 first") from None
    if sys.stdin is None or sys.stdin.isatty():
        raise TinyLMError("no input: give --text TEXT, --file PATH, or pipe text on stdin")
    return sys.stdin.read()


def add_role_flags(p: argparse.ArgumentParser) -> None:
    for role, what in (("bos", "starts a text"), ("eos", "ends a text (generation stops there)"),
                       ("pad", "fills short rows")):
        p.add_argument(f"--{role}", metavar="TOKEN", help=f"the special token that {what}, where the tokenizer's files "
                       "do not name it (default: tokenizer_config.json's; bos and pad fall back to eos)")


def roles_from(args: argparse.Namespace) -> dict[str, str] | None:
    """--bos/--eos/--pad: the special tokens a Hugging Face tokenizer's own files do not name."""
    roles = {role: getattr(args, role) for role in ("bos", "eos", "pad") if getattr(args, role, None)}
    return roles or None


def add_sampling_flags(p: argparse.ArgumentParser, seed_help: str = "make the sampling reproducible") -> None:
    """--temperature, --top-k, --top-p, --min-p and --seed: how a next token is drawn, alike for sample and chat."""
    p.add_argument("--temperature", type=nonneg_float, default=1.0, metavar="T",
                   help="divide the logits by this; 0 is greedy decoding (default: 1.0)")
    p.add_argument("--top-k", type=positive_int, metavar="K", help="keep only the k most likely tokens (default: off)")
    p.add_argument("--top-p", type=probability, metavar="P",
                   help="keep the smallest set of most likely tokens whose probability reaches p (default: off)")
    p.add_argument("--min-p", type=probability, metavar="P",
                   help="keep tokens at least this fraction as likely as the most likely one (default: off)")
    p.add_argument("--seed", type=seed_int, metavar="N", help=f"{seed_help} (default: a fresh seed each run)")


def add_command(sub: argparse._SubParsersAction, name: str, func: Callable[..., int], summary: str,
                **kwargs) -> argparse.ArgumentParser:
    """Declare the command ``name``, run by ``func``: ``summary`` is its line in the parent's --help, and its own
    --help describes it with ``func``'s docstring, so what a command does is written once, where it is done.

    The parser is kept in ``args.parser`` so that an unknown flag is reported by the command's own parser
    (`tinylm train: error: ...`, pointing at `tinylm train --help`). ``kwargs`` go to ``add_parser``
    (``allow_abbrev=False``, ...). Returns the command's parser, for its flags.
    """
    p = sub.add_parser(name, help=summary, description=inspect.getdoc(func), **kwargs)
    p.set_defaults(func=func, parser=p)
    return p


def show_help(parser: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    """For a command group run without its action (`tinylm tokenizer`): print its help, exit 2."""

    def show(args: argparse.Namespace) -> int:
        parser.print_help(sys.stderr)
        return 2

    return show


def settings_from(args: argparse.Namespace) -> dict[str, object]:
    """The setting flags given on the command line, ``{"model.n_layer": "6", ...}``, values as typed."""
    return {k[len(SETTING_PREFIX):]: v for k, v in vars(args).items() if k.startswith(SETTING_PREFIX)}


def add_setting_flags(p: argparse.ArgumentParser, sections: tuple[str, ...] = tuple(SECTIONS)) -> None:
    """One flag per configuration field of ``sections`` ([model] and [train]), generated from the dataclasses.

    Values stay text here; `apply_overrides` parses and checks them, so a flag and a TOML key
    give the same errors. Only the flags given on the command line end up in the namespace.
    The defaults shown are the tiny preset's, which is where `tinylm train` starts. `tinylm train` and
    `tinylm explain cost` share these flags, so a model is spelled the same way for both.
    """
    tiny = resolve_config(preset=DEFAULT_PRESET)
    for section, cls in SECTIONS.items():
        if section not in sections:
            continue
        group = p.add_argument_group(
            f"[{section}] settings",
            "override the preset and --config file, e.g. --n-layer 6" if section == "model"
            else "override the preset and --config file, e.g. --max-steps 500 --eval-interval 100",
        )
        types = field_types(cls)
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            dest = f"{SETTING_PREFIX}{section}.{f.name}"
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
                               action=OneFamily if f.name == "family" else "store",
                               help=f"{help_text} (tiny: {shown})".replace("%", "%%"))


class OneFamily(argparse.Action):
    """--model and --family are one setting: given both, they must agree (otherwise the last would win unseen)."""

    def __call__(self, parser, namespace, values, option_string=None):
        before = getattr(namespace, self.dest, None)
        if before is not None and before != values:
            parser.error(f"{option_string} {values} contradicts the family given before ({before}); "
                         "give --model (or --family) once")
        setattr(namespace, self.dest, values)
