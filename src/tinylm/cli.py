"""The `tinylm` command: thin argparse subcommands over the library.

Each subcommand parses its flags and calls one library function; everything it does can be
done from Python too. A user mistake raises `TinyLMError`, which is printed as one line on
stderr with exit status 2 and no traceback; so is a bad flag value.

    tinylm tokenizer train --corpus shakespeare --kind bpe --vocab-size 4096 --out tok.json
    tinylm tokenizer encode --tokenizer tok.json --text "To be, or not to be" --show
    tinylm tokenizer info --tokenizer tok.json
    tinylm prepare --corpus shakespeare --out data/shakespeare
    tinylm train                                   # the tiny preset on Shakespeare, into runs/tiny-shakespeare
    tinylm train --preset tiny --max-steps 200 --lr 2e-3 --out runs/quick
    tinylm eval runs/quick
    tinylm eval runs/quick --stride 64             # sliding windows: more context for every target
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn

from tinylm.errors import TinyLMError


class _Parser(argparse.ArgumentParser):
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


_positive_int = _number(int, "a positive integer", lambda v: v >= 1)
_seed = _number(int, "an integer from 0 to 2**63 - 1", lambda v: 0 <= v < 2**63)
_integer = _number(int, "an integer", lambda v: True)  # a range the library checks (it knows the bounds)
_nonneg_float = _number(float, "a number >= 0", lambda v: v >= 0)
_probability = _number(float, "a number between 0 and 1", lambda v: 0.0 <= v <= 1.0)
_fraction = _number(float, "a number strictly between 0 and 1", lambda v: 0.0 < v < 1.0)
_port = _number(int, "a port number from 0 (any free port) to 65535", lambda v: 0 <= v <= 65535)


# ----- shared flag groups ---------------------------------------------------------------------


def _add_corpus_flags(p: argparse.ArgumentParser, default: str | None = "shakespeare", what: str = "") -> None:
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


def _load_corpus(args: argparse.Namespace):
    """The corpus the corpus flags name, or None where --corpus is optional and not given."""
    from tinylm.data.corpora import load_corpus

    if args.corpus is None:
        if args.glob is not None or args.text_field != "text" or args.errors != "strict" or args.encoding != "utf-8":
            raise TinyLMError(
                "--glob, --text-field, --encoding and --errors say how to read --corpus; give --corpus too")
        return None
    return load_corpus(args.corpus, glob=args.glob, text_field=args.text_field, errors=args.errors,
                       encoding=args.encoding)


def _add_tokenizer_training_flags(p: argparse.ArgumentParser, vocab_default: int) -> None:
    from tinylm.tokenizers import PATTERNS

    p.add_argument("--kind", choices=["bpe", "char", "word"], default="bpe", help="tokenizer kind (default: bpe)")
    p.add_argument(
        "--vocab-size",
        type=_positive_int,
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
    p.add_argument("--workers", type=_positive_int, help="processes for counting and encoding (default: all cores)")


def _train_tokenizer(args: argparse.Namespace, corpus):
    from tinylm.tokenizers import train_tokenizer

    return train_tokenizer(args.kind, corpus.texts(), vocab_size=args.vocab_size, pattern=args.pattern,
                           unknown=args.unknown, n_reserved=args.reserved, workers=args.workers,
                           progress=sys.stderr.isatty())


def _read_input(args: argparse.Namespace) -> str:
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


# ----- tinylm tokenizer ... -------------------------------------------------------------------


def cmd_tokenizer_train(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if out.exists() and not args.force:
        raise TinyLMError(f"{out} already exists; choose another --out or pass --force to overwrite it")
    corpus = _load_corpus(args)
    start = time.perf_counter()
    tok = _train_tokenizer(args, corpus)
    tok.save(out)
    print(f"trained a {tok.kind} tokenizer with |V| = {tok.vocab_size} on {corpus.name} in "
          f"{time.perf_counter() - start:.1f}s; saved to {out}")
    return 0


def cmd_tokenizer_encode(args: argparse.Namespace) -> int:
    from tinylm.tokenizers import load_tokenizer

    tok = load_tokenizer(args.tokenizer)
    text = _read_input(args)
    allowed = "all" if args.allow_special else ()
    ids = tok.encode(text, allowed_special=allowed)
    if args.count:
        n_bytes = len(text.encode("utf-8"))
        ratio = n_bytes / len(ids) if ids else 0.0
        print(f"{len(ids)} tokens, {len(text)} characters, {n_bytes} bytes ({ratio:.2f} bytes per token)")
    elif args.show:
        for i, piece in tok.pieces(text, allowed_special=allowed):
            shown = piece.decode("utf-8", errors="backslashreplace")
            print(f"{i:>7}  {shown!r}")
    else:
        print(" ".join(map(str, ids)))
    return 0


def cmd_tokenizer_decode(args: argparse.Namespace) -> int:
    from tinylm.tokenizers import load_tokenizer

    tok = load_tokenizer(args.tokenizer)
    words = args.ids if args.ids else (sys.stdin.read().split() if not sys.stdin.isatty() else [])
    if not words:
        raise TinyLMError("no ids to decode: give them as arguments or on stdin, e.g. `tinylm tokenizer decode --tokenizer tok.json 72 101`")
    try:
        ids = [int(w) for w in words]
    except ValueError:
        bad = next(w for w in words if not w.lstrip("-").isdigit())
        raise TinyLMError(f"token ids must be integers, got {bad!r}") from None
    sys.stdout.write(tok.decode(ids))
    if sys.stdout.isatty():
        sys.stdout.write("\n")
    return 0


def cmd_tokenizer_info(args: argparse.Namespace) -> int:
    from tinylm.tokenizers import load_tokenizer

    tok = load_tokenizer(args.tokenizer)
    info: dict[str, object] = {
        "kind": tok.kind,
        "vocab_size": tok.vocab_size,
        "base_vocab_size": tok.base_vocab_size,
        "special_tokens": tok.special_tokens,
        "fingerprint": tok.fingerprint(),
    }
    if tok.kind == "bpe":
        from tinylm.tokenizers.bpe import pattern_name

        info["pattern"] = pattern_name(tok.pattern) or tok.pattern
        info["merges"] = len(tok.merges)
        longest = sorted(range(256, tok.base_vocab_size), key=lambda i: (-len(tok.token_bytes(i)), i))[:5]
        info["longest_tokens"] = [tok.token_bytes(i).decode("utf-8", "backslashreplace") for i in longest]
    elif tok.kind in ("char", "word"):
        info["unknown"] = tok.unknown
    else:  # imported: the author's ids, roles and pipeline
        info["roles"] = tok.roles
        info["adds_bos"] = tok.add_bos
        info["merges"] = len(tok.merges)
        info["chat_template"] = tok.chat_template is not None
    if args.json:
        print(json.dumps(info, ensure_ascii=False, indent=1))
    else:
        for key, value in info.items():
            print(f"{key:>16}: {value}")
    return 0


def cmd_tokenizer_export(args: argparse.Namespace) -> int:
    from tinylm.tokenizers import load_tokenizer
    from tinylm.tokenizers.files import export_tokenizer

    tok = load_tokenizer(args.tokenizer)
    path = export_tokenizer(tok, args.out, args.format, overwrite=args.force)
    print(f"wrote {args.format} tokenizer to {path}")
    return 0


def _roles(args: argparse.Namespace) -> dict[str, str] | None:
    """--bos/--eos/--pad: the special tokens a Hugging Face tokenizer's own files do not name."""
    roles = {role: getattr(args, role) for role in ("bos", "eos", "pad") if getattr(args, role, None)}
    return roles or None


def cmd_tokenizer_import(args: argparse.Namespace) -> int:
    from tinylm.tokenizers.files import import_tokenizer

    out = Path(args.out)
    if out.exists() and not args.force:
        raise TinyLMError(f"{out} already exists; choose another --out or pass --force to overwrite it")
    tok = import_tokenizer(args.path, pattern=args.pattern, n_reserved=args.reserved, roles=_roles(args))
    tok.save(out)
    print(f"imported a {tok.kind} tokenizer with |V| = {tok.vocab_size} from {args.path}; saved to {out}")
    return 0


# ----- tinylm prepare ---------------------------------------------------------------------------


def cmd_prepare(args: argparse.Namespace) -> int:
    from tinylm.data.corpora import corpus_stem
    from tinylm.data.shards import check_output_folder, prepare
    from tinylm.tokenizers import load_tokenizer

    corpus = _load_corpus(args)
    out = Path(args.out) if args.out else Path("data") / corpus_stem(corpus.name)
    check_output_folder(out)  # before a tokenizer is trained and saved there
    if args.tokenizer:
        tok = load_tokenizer(args.tokenizer)
    else:
        # No tokenizer given: train one on the corpus, or reuse the one trained here last time.
        tok_path = out / "tokenizer.json"
        if tok_path.exists() and not args.force:
            tok = load_tokenizer(tok_path)
            print(f"reusing the tokenizer in {tok_path} (pass --force to train a new one)")
        else:
            start = time.perf_counter()
            tok = _train_tokenizer(args, corpus)
            tok.save(tok_path)
            print(f"trained a {tok.kind} tokenizer with |V| = {tok.vocab_size} in {time.perf_counter() - start:.1f}s: {tok_path}")
    start = time.perf_counter()
    shards = prepare(
        corpus, tok, out, val_fraction=args.val_fraction, seed=args.seed, workers=args.workers,
        progress=sys.stderr.isatty(), overwrite=args.force,
    )
    verb = "reused" if shards.reused else f"wrote in {time.perf_counter() - start:.1f}s"
    print(f"{verb}: token shards in {out}")
    for split in ("train", "val"):
        m = shards.meta["splits"][split]
        print(f"  {split:>5}: {m['documents']:>6} documents {m['tokens']:>11,} tokens {m['bytes']:>12,} bytes "
              f"({m['bytes'] / max(m['tokens'], 1):.2f} bytes/token)")
    return 0


# ----- tinylm train / eval ------------------------------------------------------------------------

_SETTING_PREFIX = "setting:"  # argparse dest of a [model]/[train] setting: "setting:<table>.<key>"


# What each [model] setting means, for --help (GPTConfig's docstring says it at length).
_MODEL_HELP = {
    "family": "which model: the Transformer (gpt), an lstm or rnn, or a counted ngram model (also --model)",
    "vocab_size": "|V|; training sets it from the tokenizer",
    "block_size": "context length T: the most tokens the model sees at once (lstm/rnn: the training windows; "
                  "ngram: the longest request tinylm serve takes)",
    "n_layer": "number of Transformer blocks (lstm/rnn: recurrent layers)",
    "d_model": "width d of every position's vector (lstm/rnn: the state's width)",
    "n_head": "query heads (each of size d_model / n_head)",
    "n_kv_head": "key/value heads for grouped-query attention (unset: as many as n_head; 1: multi-query)",
    "mlp": "the MLP: GELU (GPT-2) or SwiGLU (Llama)",
    "d_head": "the size of one attention head (unset: d_model / n_head)",
    "d_ff": "the MLP's hidden width (unset: 4 d for gelu, about 8/3 d for swiglu)",
    "norm": "LayerNorm or RMSNorm",
    "norm_position": "normalize each sublayer's input (pre) or after each residual addition (post)",
    "norm_eps": "the norms' epsilon",
    "positions": "position information: learned, sinusoidal, rotary (rope) or none",
    "rope_theta": "RoPE's base",
    "rope_scaling": "stretch RoPE's frequencies: none, linear (all divided by --rope-factor) or llama3 (Llama 3.1)",
    "rope_factor": "linear and llama3 scaling: the factor the (low) frequencies are divided by",
    "rope_low_freq_factor": "llama3 scaling: wavelengths above original context / this are divided by the factor",
    "rope_high_freq_factor": "llama3 scaling: wavelengths below original context / this are kept",
    "rope_original_context": "llama3 scaling: the context the model was first trained at",
    "sliding_window": "each query attends to itself and the W - 1 positions before it (Mistral; unset: all)",
    "bias": "biases on linear layers and LayerNorm",
    "qkv_bias": "biases on the q, k, v projections only, for a --no-bias model (Qwen2)",
    "tie_embeddings": "share the output head with the token embedding E",
    "dropout": "dropout probability",
    "init_std": "standard deviation of the initial weights",
    "attention": "attention implementation: fused (sdpa), the definition (reference) or tiled online softmax",
    "tile_size": "key block size of tiled attention",
    "bptt": "lstm/rnn: backpropagate through at most this many steps (truncated BPTT; unset: the whole window)",
    "order": "ngram: the n of n-gram (the context is n - 1 tokens)",
    "smoothing": "ngram: Kneser-Ney (kn), add-k, unsmoothed counts (mle), or nltk's KN (kn-nltk)",
    "add_k": "ngram: the pseudo-count of --smoothing add-k",
}


def _add_setting_flags(p: argparse.ArgumentParser) -> None:
    """One flag per configuration field, [model] and [train], generated from the dataclasses.

    Values stay text here; `apply_overrides` parses and checks them, so a flag and a TOML key
    give the same errors. Only the flags given on the command line end up in the namespace.
    The defaults shown are the tiny preset's, which is where `tinylm train` starts.
    """
    import dataclasses
    import typing

    from tinylm.config import SECTIONS, _type_hints, resolve_config

    tiny = resolve_config(preset="tiny")
    for section, cls in SECTIONS.items():
        group = p.add_argument_group(
            f"[{section}] settings",
            "override the preset and --config file, e.g. --n-layer 6" if section == "model"
            else "override the preset and --config file, e.g. --lr 2e-3 --max-steps 500",
        )
        hints = _type_hints(cls)
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            dest = f"{_SETTING_PREFIX}{section}.{f.name}"
            tp = hints[f.name]
            help_text = f.metadata.get("help") or _MODEL_HELP.get(f.name, f"[{section}] {f.name}")
            default = getattr(getattr(tiny, section), f.name)
            if tp is bool:
                group.add_argument(flag, dest=dest, action="store_const", const=True, default=argparse.SUPPRESS,
                                   help=f"{help_text}; --no-{flag[2:]} to turn off (tiny: {str(default).lower()})")
                group.add_argument("--no-" + flag[2:], dest=dest, action="store_const", const=False,
                                   default=argparse.SUPPRESS, help=argparse.SUPPRESS)
                continue
            inner = [a for a in typing.get_args(tp) if a is not type(None)] or [tp]
            inner_tp = inner[0] if typing.get_origin(tp) is not typing.Literal else tp
            if typing.get_origin(inner_tp) is typing.Literal:
                metavar = "{" + ",".join(typing.get_args(inner_tp)) + "}"
            else:
                metavar = {int: "N", float: "X"}.get(inner_tp, "TEXT")
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


def _settings(args: argparse.Namespace) -> dict[str, object]:
    return {k[len(_SETTING_PREFIX):]: v for k, v in vars(args).items() if k.startswith(_SETTING_PREFIX)}


def _train_config(args: argparse.Namespace):
    """The configuration the flags describe; None on --resume with nothing changed (the run's own)."""
    from tinylm.config import (FAMILY_NAMES, apply_overrides, build_config, load_config_file, load_preset,
                               tie_without_head_settings)

    settings = _settings(args)
    mine = load_config_file(args.config, own_only=True) if args.config else {}
    if args.resume and not (args.preset or args.config or settings):
        return None
    if args.resume and not (args.preset or args.config):
        saved = Path(args.out) / "config.toml"
        base = load_config_file(saved) if saved.exists() else load_preset("tiny")
        theirs, wanted = base.get("model", {}).get("family", "gpt"), settings.get("model.family")
        if saved.exists() and wanted is not None and wanted != theirs:
            raise TinyLMError(f"{args.out} is a run of {FAMILY_NAMES[theirs]} model, not {FAMILY_NAMES[wanted]} one; "
                              f"resume it with its own settings (drop --model), or start the new run in another --out")
    else:
        # `--model lstm` (or rnn) alone starts from that preset: the tiny run's data, a tuned recurrent model;
        # fine-tuning (--init-from) takes tiny's [train] settings whether or not the family is named
        family = settings.get("model.family")
        default = family if family in ("lstm", "rnn") and not args.init_from else "tiny"
        base = load_preset(args.preset or default) if (args.preset or not args.config) else {}
        # a --config file without a preset = line starts where the command does, not from the dataclass defaults
        init_config = Path(args.init_from or "") / "config.toml"
        if args.init_from and not (args.preset or args.config) and init_config.is_file():
            # fine-tuning: the model is the one being started from; the [train] settings are tiny's
            theirs = load_config_file(init_config).get("model", {})
            wanted, family = settings.get("model.family"), theirs.get("family", "gpt")
            if wanted is not None and wanted != family:
                raise TinyLMError(f"--init-from {args.init_from} is a run of {FAMILY_NAMES[family]} model; "
                                  f"{FAMILY_NAMES[wanted]} model cannot start from its weights: drop --model, or "
                                  "train the new model from scratch")
            base = dict(base, model=theirs)
        if args.config:
            from tinylm.config import _merge

            base = _merge(base, load_config_file(args.config, default_preset=None if args.preset else default))
    return build_config(tie_without_head_settings(apply_overrides(base, settings), apply_overrides(mine, settings)))


def _default_run_dir(args: argparse.Namespace) -> Path:
    """runs/<preset or config file name>-<corpus name>, e.g. runs/tiny-shakespeare (runs/lstm-shakespeare
    for `--model lstm`, runs/rnn-shakespeare for `--model rnn`)."""
    from tinylm.data.corpora import corpus_stem

    settings = _settings(args)
    corpus = str(settings.get("train.corpus", "shakespeare"))
    if args.config and "train.corpus" not in settings:
        from tinylm.config import load_config_file

        corpus = str(load_config_file(args.config).get("train", {}).get("corpus", corpus))
    recipe = args.preset or (Path(args.config).stem if args.config else "tiny")
    family = str(settings.get("model.family", "gpt"))
    if family != "gpt" and recipe != family:  # runs/lstm-shakespeare beside runs/tiny-shakespeare, not on top of it
        recipe = family if not (args.preset or args.config) else f"{recipe}-{family}"
    return Path("runs") / f"{recipe}-{corpus_stem(corpus)}"


# Which settings each family reads; a flag given for another family is ignored, with a warning.
_TRANSFORMER_ONLY = {"n_head", "n_kv_head", "d_head", "mlp", "d_ff", "norm", "norm_position", "norm_eps", "positions",
                     "rope_theta", "rope_scaling", "rope_factor", "rope_low_freq_factor", "rope_high_freq_factor",
                     "rope_original_context", "sliding_window", "bias", "qkv_bias", "attention", "tile_size"}
_NGRAM_ONLY = {"order", "smoothing", "add_k"}
_COUNTING_READS = {"model.family", "model.vocab_size", "model.block_size", "model.order", "model.smoothing",
                   "model.add_k", "train.corpus", "train.glob", "train.text_field", "train.encoding", "train.errors",
                   "train.tokenizer", "train.tokenizer_kind", "train.tokenizer_vocab_size", "train.tokenizer_pattern",
                   "train.data_dir", "train.val_fraction", "train.seed", "train.sample_tokens",
                   "train.sample_temperature", "train.sample_top_k", "train.device"}


def _unused_settings(config, settings: dict[str, object], stop_after: int | None) -> list[str]:
    """The flags given on the command line that ``config.model.family`` has no use for."""
    family = config.model.family
    unused = []
    for key in settings:
        section, name = key.split(".", 1)
        if family == "ngram":
            skip = key not in _COUNTING_READS
        elif section == "model":
            skip = name in _NGRAM_ONLY or (family != "gpt" and name in _TRANSFORMER_ONLY)
        else:
            skip = False
        if skip:
            unused.append("--" + name.replace("_", "-"))
    if family == "ngram" and "model.add_k" in settings and config.model.smoothing != "add-k":
        unused.append("--add-k")
    if family == "ngram" and stop_after is not None:
        unused.append("--stop-after")
    return sorted(set(unused))


def cmd_train(args: argparse.Namespace) -> int:
    from tinylm.config import FAMILY_NAMES
    from tinylm.train import train

    if args.out is None:
        args.out = str(_default_run_dir(args))
    config = _train_config(args)
    if args.print_config:
        from tinylm.config import dump_toml, load_config_file

        if config is None:  # --resume with nothing changed: the run's own
            print(dump_toml(load_config_file(Path(args.out) / "config.toml")), end="")
        else:
            print(dump_toml(config.to_dict()), end="")
        return 0
    unused = _unused_settings(config, _settings(args), args.stop_after) if config is not None else []
    pending = []
    if unused:
        pending.append(f"tinylm: warning: {', '.join(unused)} {'does' if len(unused) == 1 else 'do'} not apply to "
                       f"{FAMILY_NAMES[config.model.family]} model and {'is' if len(unused) == 1 else 'are'} ignored")

    def log(line: str) -> None:
        # the warning goes out with the run's first line: a run refused before it starts shows its error alone
        while pending:
            print(pending.pop(0), file=sys.stderr, flush=True)
        print(line, flush=True)

    resume = False if args.resume is None else args.resume
    train(config, args.out, resume=resume, force=args.force, init_from=args.init_from,
          stop_after=args.stop_after, progress=None if args.progress else False, log=log)
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from tinylm.evaluate import evaluate_run

    run = args.run_flag or args.run
    if run is None:
        raise TinyLMError("give the run to evaluate: tinylm eval --run DIR (a run folder or an n-gram .npz file)")
    if args.run_flag and args.run and args.run_flag != args.run:
        raise TinyLMError("give the run once, with --run or as the argument, not both")
    if args.corpus and args.split != "val":
        raise TinyLMError("--split picks a split of the run's shards; --corpus evaluates on a whole corpus instead")
    result = evaluate_run(run, args.split, checkpoint=args.checkpoint, max_tokens=args.tokens or 0,
                          stride=args.stride, batch_size=args.batch_size, data_dir=args.data_dir,
                          corpus=_load_corpus(args), tokenizer=args.tokenizer, device=args.device,
                          progress=sys.stderr.isatty())
    if args.json:
        print(json.dumps({"run": str(run), **result.report()}))
        return 0
    scope = "bytes prorated from a subset" if result.prorated else "all of it"
    where = f"the corpus {args.corpus}" if args.corpus else f"the {args.split} split"
    print(f"{run} on {where} ({result.describe_windows()}): loss {result.loss:.4f} nats per token, "
          f"perplexity {result.perplexity:.2f}, {result.bits_per_byte:.4f} bits per byte")
    print(f"  {result.tokens:,} tokens, {result.bytes:,.0f} bytes ({scope}), {result.seconds:.1f} s")
    if result.unknown_tokens:
        print(f"  {result.unknown_tokens:,} of the tokens are <unk>, standing for {result.unknown_bytes:,.0f} bytes the "
              "tokenizer cannot spell; bits per byte charges them 8 bits each")
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from tinylm.compare import check_plot_path, compare_runs, format_table, plot_comparison

    if args.corpus and args.split != "val":
        raise TinyLMError("--split picks a split of each run's shards; --corpus evaluates on a whole corpus instead")
    check_plot_path(args.plot)
    rows = compare_runs(args.runs, split=args.split, corpus=_load_corpus(args), max_tokens=args.tokens or 0,
                        stride=args.stride, device=args.device)
    chart = plot_comparison(rows, args.plot)
    if args.json:
        print(json.dumps({"chart": str(chart), "runs": [
            {"run": r.name, "family": r.family, "size": r.size, "tokenizer": r.tokenizer, **r.result.report()}
            for r in sorted(rows, key=lambda r: r.result.bits_per_byte)]}))
        return 0
    print(format_table(rows))
    print(f"chart: {chart}")
    return 0


def cmd_sample(args: argparse.Namespace) -> int:
    from tinylm.generate.commands import cmd_sample as sample

    return sample(args)


def cmd_next_token(args: argparse.Namespace) -> int:
    from tinylm.generate.commands import cmd_next_token as next_token

    return next_token(args)


def cmd_serve(args: argparse.Namespace) -> int:
    from tinylm.serve.server import cmd_serve as serve

    return serve(args)


def cmd_export(args: argparse.Namespace) -> int:
    from tinylm.export import export_run

    extra = {"dtype": args.dtype} if args.dtype else {}
    if args.dtype and args.format != "gguf":
        raise TinyLMError("--dtype applies to --format gguf only; Hugging Face export writes float32")
    path = export_run(args.run, args.out, args.format, checkpoint=args.checkpoint, overwrite=args.force, **extra)
    print(f"exported {args.run} ({args.checkpoint} checkpoint) as {args.format}: {path}")
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    from tinylm.export import import_hf_into_run

    run = import_hf_into_run(args.source, args.out, force=args.force, roles=_roles(args))
    print(f"imported {args.source} into the run {run}; sample, eval, serve or fine-tune it with --init-from {run}")
    return 0


def _show_help(parser: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    """For a command group run without its action (`tinylm tokenizer`): print its help, exit 2."""

    def show(args: argparse.Namespace) -> int:
        parser.print_help(sys.stderr)
        return 2

    return show


# ----- the parser -------------------------------------------------------------------------------


STRIDE_HELP = (
    "sliding windows: a window of block_size tokens every S tokens, scoring only the targets no window before it "
    "scored (1 <= S <= block_size), so each target is scored once with at least block_size - S + 1 tokens of "
    "context; costs about block_size / S times more (default: disjoint windows, the same as S = block_size). An "
    "LSTM or RNN restarts its state in each window, so it gains context too; an n-gram model reads its own "
    "context whatever S. With --tokens: evenly spaced windows of S scored targets each")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="tinylm",
        description="Autoregressive Transformer language models end to end: tokenize, prepare data, "
        "train, evaluate, generate.",
    )
    from tinylm import __version__

    parser.add_argument("--version", action="version", version=f"tinylm {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    # tinylm tokenizer ...
    tok = sub.add_parser("tokenizer", help="train, inspect and convert tokenizers",
                         description="Train, use, inspect, export and import tokenizers.")
    tok.set_defaults(func=_show_help(tok))
    tsub = tok.add_subparsers(dest="tokenizer_command", metavar="ACTION", parser_class=_Parser)

    p = tsub.add_parser("train", help="train a tokenizer on a corpus",
                        description="Train a byte-level BPE, character or word tokenizer on a corpus "
                        "and save it as tinylm JSON.")
    _add_corpus_flags(p)
    _add_tokenizer_training_flags(p, vocab_default=4096)
    p.add_argument("--out", required=True, help="where to save the tokenizer (JSON)")
    p.add_argument("--force", action="store_true", help="overwrite --out if it exists")
    p.set_defaults(func=cmd_tokenizer_train, parser=p)

    def add_input(p: argparse.ArgumentParser) -> None:
        p.add_argument("--tokenizer", required=True, help="a tinylm tokenizer JSON file")
        src = p.add_mutually_exclusive_group()
        src.add_argument("--text", help="the text (default: read --file, or stdin)")
        src.add_argument("--file", help="read the text from this UTF-8 file")

    p = tsub.add_parser("encode", help="encode text to ids, count tokens, or show the split",
                        description="Encode text with a tokenizer. Prints the ids, or with --count the "
                        "number of tokens, or with --show one line per token with its text.")
    add_input(p)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--count", action="store_true", help="print the token, character and byte counts")
    mode.add_argument("--show", action="store_true", help="print each token's id and text, one per line")
    p.add_argument("--allow-special", action="store_true",
                   help="treat special-token text such as <|eos|> in the input as the special token "
                   "(default: it is plain text)")
    p.set_defaults(func=cmd_tokenizer_encode, parser=p)

    p = tsub.add_parser("decode", help="decode ids to text",
                        description="Decode token ids (arguments or whitespace-separated on stdin) to text.")
    p.add_argument("--tokenizer", required=True, help="a tinylm tokenizer JSON file")
    p.add_argument("ids", nargs="*", help="token ids")
    p.set_defaults(func=cmd_tokenizer_decode, parser=p)

    p = tsub.add_parser("info", help="describe a tokenizer", description="Print a tokenizer's kind, sizes, "
                        "special tokens, split pattern and fingerprint.")
    p.add_argument("--tokenizer", required=True, help="a tinylm tokenizer JSON file")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_tokenizer_info, parser=p)

    p = tsub.add_parser("export", help="write a BPE tokenizer as tokenizer.json or .tiktoken",
                        description="Export a BPE tokenizer for other tools: a Hugging Face tokenizer.json "
                        "(loads in `tokenizers` and `transformers`) or a tiktoken ranks file.")
    p.add_argument("--tokenizer", required=True, help="a tinylm tokenizer JSON file")
    p.add_argument("--format", required=True, choices=["hf", "tiktoken"], help="hf or tiktoken")
    p.add_argument("--out", required=True, help="output file (or folder for hf: writes tokenizer.json in it)")
    p.add_argument("--force", action="store_true", help="overwrite --out if it exists")
    p.set_defaults(func=cmd_tokenizer_export, parser=p)

    p = tsub.add_parser("import", help="read a tokenizer.json, vocab.json + merges.txt or .tiktoken file into tinylm",
                        description="Import a Hugging Face tokenizer (tokenizer.json: byte-level BPE such as GPT-2's, "
                        "Llama 3's or Qwen2's, or SentencePiece-style BPE with byte fallback such as Llama 2's and "
                        "Mistral's; or GPT-2's vocab.json + merges.txt) or a tiktoken ranks file as a tinylm "
                        "tokenizer. Every token keeps its id.")
    p.add_argument("path", help="a tokenizer.json, a vocab.json (merges.txt beside it), a folder holding one, or a "
                   ".tiktoken file; tokenizer_config.json beside it names bos, eos, pad and the chat template")
    p.add_argument("--out", required=True, help="where to save the tinylm tokenizer JSON")
    p.add_argument("--pattern", help="only for .tiktoken files, which carry no split pattern (default: gpt4)")
    p.add_argument("--reserved", type=int, help="only for .tiktoken files, which carry no special tokens: "
                   "how many reserved tokens follow bos, eos, pad (default: 0)")
    _role_arguments(p)
    p.add_argument("--force", action="store_true", help="overwrite --out if it exists")
    p.set_defaults(func=cmd_tokenizer_import, parser=p)

    # tinylm prepare
    p = sub.add_parser("prepare", help="tokenize a corpus into train/validation token shards",
                       description="Tokenize a corpus into binary token shards (numpy memmaps) with a "
                       "deterministic train/validation split by document and EOS between documents. "
                       "Without --tokenizer, trains one on the corpus first. Running it again on the "
                       "same inputs reuses the result.")
    _add_corpus_flags(p)
    p.add_argument("--tokenizer", help="a tinylm tokenizer JSON file (default: train one, see --kind)")
    _add_tokenizer_training_flags(p, vocab_default=4096)
    p.add_argument("--out", help="output folder (default: data/CORPUS)")
    p.add_argument("--val-fraction", type=_fraction, default=0.1, help="share of documents for validation (default: 0.1)")
    p.add_argument("--seed", type=_seed, default=0, help="seed of the train/validation split (default: 0)")
    p.add_argument("--force", action="store_true", help="re-train the tokenizer and rewrite the shards")
    p.set_defaults(func=cmd_prepare, parser=p)

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
    p.add_argument("--stop-after", type=_positive_int, metavar="STEPS",
                   help="stop after this many steps with a checkpoint, as if interrupted (resume later)")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress bar or progress lines")
    p.add_argument("--print-config", action="store_true",
                   help="print the resolved configuration as TOML and exit: nothing is trained or written")
    p.add_argument("--model", dest=f"{_SETTING_PREFIX}model.family", choices=["gpt", "lstm", "rnn", "ngram"],
                   action=_OneFamily, default=argparse.SUPPRESS, help="which model to train: the Transformer (gpt, default), an LSTM or "
                   "RNN by the same loop, or an n-gram model by counting (the same as --family)")
    _add_setting_flags(p)
    p.set_defaults(func=cmd_train, parser=p)

    # tinylm eval
    p = sub.add_parser("eval", help="loss, perplexity and bits per byte of a trained run (any model family)",
                       description="Evaluate a trained run (Transformer, LSTM, RNN or n-gram) on a split of the "
                       "token shards it was trained on, or on any corpus: mean loss per token, perplexity, bits per "
                       "byte of the original text, the tokens and bytes counted, and the time it took. A network "
                       "reads the text in disjoint windows of its block_size unless --stride slides them.")
    p.add_argument("run", nargs="?", help=argparse.SUPPRESS)
    p.add_argument("--run", dest="run_flag", metavar="DIR",
                   help="the run folder (e.g. runs/tiny-shakespeare), or an n-gram model file (.npz)")
    p.add_argument("--checkpoint", choices=["best", "latest"], default="best", help="which checkpoint (default: best)")
    p.add_argument("--split", choices=["val", "train"], default="val", help="which split (default: val)")
    _add_corpus_flags(p, default=None, what="evaluate on this corpus instead of a split, tokenized with the run's "
                      "tokenizer:")
    p.add_argument("--tokenizer", help="for an n-gram .npz file: the tokenizer JSON it was counted with")
    p.add_argument("--tokens", type=_positive_int, help="evaluate evenly spaced windows of about this many tokens "
                   "(default: the whole split; an n-gram model always scores all of it, in seconds)")
    p.add_argument("--stride", type=_integer, metavar="S", help=STRIDE_HELP)
    p.add_argument("--batch-size", type=_positive_int, help="windows per forward pass (default: about 1024 tokens' "
                   "worth, the fastest on a CPU)")
    p.add_argument("--data-dir", help="the run's shard folder, if it has moved since training")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or mps (default: cpu)")
    p.add_argument("--json", action="store_true", help="print the numbers as one JSON object (for scripts)")
    p.set_defaults(func=cmd_eval, parser=p)

    # tinylm compare
    p = sub.add_parser("compare", help="evaluate several runs on the same text: a table and a bar chart",
                       description="Evaluate runs of any family and tokenizer (n-gram, RNN, LSTM, Transformer) on "
                       "their validation split, or all on one --corpus, and print a table sorted by bits per byte, "
                       "the measure that is fair across tokenizers; draw the bits per byte as a bar chart (PNG).")
    p.add_argument("runs", nargs="+", metavar="RUN", help="run folders")
    p.add_argument("--split", choices=["val", "train"], default="val", help="which split (default: val)")
    _add_corpus_flags(p, default=None, what="evaluate every run on this corpus instead of its split:")
    p.add_argument("--tokens", type=_positive_int, help="evaluate about this many tokens per network "
                   "(default: all; n-gram models always score all)")
    p.add_argument("--stride", type=_integer, metavar="S", help=STRIDE_HELP)
    p.add_argument("--plot", default="compare.png", metavar="PATH", help="the bar chart (default: compare.png)")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or mps (default: cpu)")
    p.add_argument("--json", action="store_true", help="print the table as JSON, best first (the chart is still "
                   "written)")
    p.set_defaults(func=cmd_compare, parser=p)

    # tinylm sample / next-token
    p = sub.add_parser("sample", help="generate text from a trained run",
                       description="Complete prompts with a trained model: sampling (temperature, top-k, top-p, "
                       "min-p; applied in that order), greedy decoding (--temperature 0) or beam search "
                       "(--num-beams). The prompt comes from --prompt (repeat it for a batch), --prompt-file, "
                       "or stdin; with none, samples start a new document. Prints each prompt and its completion.")
    p.add_argument("--run", required=True, metavar="DIR", help="the run folder written by `tinylm train`")
    p.add_argument("--checkpoint", choices=["best", "latest"], default="best", help="which checkpoint (default: best)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", action="append", metavar="TEXT",
                     help="a prompt; give it several times to complete several prompts in one batch")
    src.add_argument("--prompt-file", metavar="PATH", help="read one prompt from this UTF-8 file")
    p.add_argument("--num-samples", type=_positive_int, default=1, metavar="N", help="samples per prompt (default: 1)")
    p.add_argument("--max-new-tokens", type=_positive_int, default=256, metavar="N",
                   help="most tokens to generate (default: 256)")
    p.add_argument("--temperature", type=_nonneg_float, default=1.0, metavar="T",
                   help="divide the logits by this; 0 is greedy decoding (default: 1.0)")
    p.add_argument("--top-k", type=_positive_int, metavar="K", help="keep only the k most likely tokens (default: off)")
    p.add_argument("--top-p", type=_probability, metavar="P",
                   help="keep the smallest set of most likely tokens whose probability reaches p (default: off)")
    p.add_argument("--min-p", type=_probability, metavar="P",
                   help="keep tokens at least this fraction as likely as the most likely one (default: off)")
    p.add_argument("--seed", type=_seed, metavar="N", help="make the sampling reproducible (default: a fresh seed each run)")
    p.add_argument("--stop", action="append", metavar="TEXT",
                   help="stop a sample at this text (not included in the output; \\n and \\t are understood); "
                   "repeat for several; the end-of-text token always stops")
    p.add_argument("--stream", action="store_true", help="print the text as it is generated (one prompt, one sample)")
    p.add_argument("--num-beams", type=_positive_int, default=1, metavar="N",
                   help="beam search with this many beams instead of sampling (default: 1, no beam search)")
    p.set_defaults(func=cmd_sample, parser=p)

    p = sub.add_parser("next-token", help="show the most likely next tokens after a prompt",
                       description="Print the model's top candidates for the token after --prompt, with their "
                       "probabilities at --temperature, or side by side at several --temperatures.")
    p.add_argument("--run", required=True, metavar="DIR", help="the run folder written by `tinylm train`")
    p.add_argument("--checkpoint", choices=["best", "latest"], default="best", help="which checkpoint (default: best)")
    p.add_argument("--prompt", required=True, metavar="TEXT", help="the text to continue")
    p.add_argument("--top", type=_positive_int, default=10, metavar="N", help="how many candidates (default: 10)")
    p.add_argument("--temperature", type=_nonneg_float, default=1.0, metavar="T",
                   help="the temperature of the probabilities (default: 1.0)")
    p.add_argument("--temperatures", metavar="T1,T2,...",
                   help="show the probabilities at several temperatures side by side, e.g. 0.5,1,2")
    p.set_defaults(func=cmd_next_token, parser=p)

    # tinylm serve
    p = sub.add_parser("serve", help="serve a trained run: an OpenAI-compatible API and a web playground",
                       description="Serve a trained run over HTTP: the OpenAI API (/v1/models, /v1/completions, "
                       "/v1/chat/completions, streaming by server-sent events) that the official openai clients "
                       "use unchanged, and a playground page at / that streams completions and charts the "
                       "next-token probabilities. Requests in flight are decoded together in batches.")
    p.add_argument("--run", required=True, metavar="DIR", help="the run folder written by `tinylm train`")
    p.add_argument("--host", default="127.0.0.1",
                   help="the address to listen on (default: 127.0.0.1, this machine only; 0.0.0.0 for every network)")
    p.add_argument("--port", type=_port, default=8000, help="the port (default: 8000; 0 picks a free one)")
    p.add_argument("--api-key", metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on the API (default: $TINYLM_API_KEY, else no key)")
    p.add_argument("--model-name", metavar="NAME", help="the model id clients ask for (default: the run folder's name)")
    p.add_argument("--allow-origin", action="append", metavar="ORIGIN",
                   help="let web pages from this origin (e.g. http://localhost:3000, or * for any) call the API "
                   "from a browser (CORS); repeat for several (default: none)")
    p.add_argument("--max-batch-size", type=_positive_int, default=32, metavar="N",
                   help="the most samples decoded together; 1 serves one at a time (default: 32)")
    p.add_argument("--batch-window-ms", type=_nonneg_float, default=2.0, metavar="MS",
                   help="how long an idle server waits for more requests to batch with the first (default: 2)")
    p.add_argument("--checkpoint", choices=["best", "latest"], default="best", help="which checkpoint (default: best)")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or mps (default: cpu)")
    p.add_argument("--threads", type=_positive_int, metavar="N", help="PyTorch CPU threads (default: PyTorch's choice)")
    p.add_argument("--log-level", choices=["critical", "error", "warning", "info", "debug"], default="info",
                   help="the server's log level; info logs every request (default: info)")
    p.set_defaults(func=cmd_serve, parser=p)

    # tinylm export / import
    p = sub.add_parser("export", help="write a trained run for transformers (hf) or llama.cpp (gguf)",
                       description="Export a trained run: a Hugging Face folder (config.json, model.safetensors, "
                       "tokenizer.json) in the GPT-2, Llama or Qwen3 layout, or a GGUF file for llama.cpp. A "
                       "configuration no architecture can express is refused with what does not map.")
    p.add_argument("--run", required=True, help="the run folder")
    p.add_argument("--format", required=True, choices=["hf", "gguf"], help="hf or gguf")
    p.add_argument("--out", required=True, help="output folder (hf) or .gguf file")
    p.add_argument("--checkpoint", choices=["best", "latest"], default="best", help="which checkpoint (default: best)")
    p.add_argument("--dtype", choices=["f32", "f16"], help="gguf tensor type (default: f32)")
    p.add_argument("--force", action="store_true", help="overwrite --out if it exists")
    p.set_defaults(func=cmd_export, parser=p)

    p = sub.add_parser("import", help="turn a local Hugging Face GPT-2, Llama, Qwen2/3 or Mistral checkpoint into "
                       "a tinylm run",
                       description="Import a local transformers checkpoint (config.json, model.safetensors, and its "
                       "tokenizer: tokenizer.json or vocab.json + merges.txt, with tokenizer_config.json) as a run "
                       "folder that sample, eval, serve and train --init-from can use. Token ids stay the model's.")
    p.add_argument("--from", dest="source", required=True, help="the Hugging Face model folder")
    p.add_argument("--out", required=True, help="the run folder to create")
    _role_arguments(p)
    p.add_argument("--force", action="store_true", help="replace --out if it is an existing tinylm run")
    p.set_defaults(func=cmd_import, parser=p)

    return parser


def _role_arguments(p: argparse.ArgumentParser) -> None:
    for role, what in (("bos", "starts a text"), ("eos", "ends a text (generation stops there)"),
                       ("pad", "fills short rows")):
        p.add_argument(f"--{role}", metavar="TOKEN", help=f"the special token that {what}, where the tokenizer's files "
                       "do not name it (default: tokenizer_config.json's; bos and pad fall back to eos)")


def _one_line_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """Warnings meant for the user (a sample outgrowing the context, ...) as one line, like errors."""
    print(f"tinylm: warning: {message}", file=sys.stderr if file is None else file)


def main(argv: Sequence[str] | None = None) -> int:
    import warnings

    warnings.showwarning = _one_line_warning
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # said by the subcommand's parser, so the hint is `tinylm train --help`, not `tinylm --help`
        getattr(args, "parser", parser).error(f"unrecognized arguments: {' '.join(extra)}")
    func: Callable[[argparse.Namespace], int] = getattr(args, "func", _show_help(parser))
    try:
        return func(args)
    except TinyLMError as e:
        print(f"tinylm: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("tinylm: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `tinylm tokenizer encode ... | head`
        sys.stderr.close()
        return 0
