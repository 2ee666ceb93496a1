"""The data a training run reads: its tokenizer found, checked or trained, and the corpus cut into shards once.

`prepare_data` is what `tinylm train` (every model family) does before its first step; the
shards go to a folder named for the corpus and the tokenizer (`default_data_dir`), so runs with
the same settings share them, and so share one validation split. A tokenizer already there is
reused only if it is the one the settings ask for.

`prepare_corpus` is `tinylm prepare`: the folder is named for the corpus alone (data/docs for
docs.jsonl), and whatever tokenizer a prepare left there is reused until ``force`` trains a new one,
so running it again costs nothing. Both lock the folder while they write it.

Usage::

    shards = prepare_data(resolve_config(preset="tiny").train)   # data/shakespeare-bpe-512, say
    shards.tokenizer(), shards.num_tokens("train")
    shards = prepare_corpus("notes/", kind="char")               # data/notes, as `tinylm prepare`
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

from tinylm.config import TrainConfig
from tinylm.config import corpus_stem
from tinylm.data.corpora import Corpus, load_corpus
from tinylm.data.shards import META_FILE, TOKENIZER_FILE, ShardSet, check_output_folder, prepare
from tinylm.errors import TinyLMError
from tinylm.lock import folder_lock
from tinylm.tokenizers import train_tokenizer
from tinylm.tokenizers.base import Tokenizer, check_same_tokenizer, load_tokenizer
from tinylm.tokenizers.bpe import resolve_pattern


def default_data_dir(tc: TrainConfig, corpus_name: str, tokenizer: Tokenizer | None = None) -> Path:
    """data/<corpus>-<tokenizer>: the kind and size of the tokenizer to train, or a given one's fingerprint."""
    name = corpus_stem(corpus_name)
    if tokenizer is not None:
        return Path("data") / f"{name}-{tokenizer.kind}-{tokenizer.fingerprint()[:8]}"
    if tc.tokenizer_kind == "char":
        return Path("data") / f"{name}-char"
    suffix = f"-{tc.tokenizer_pattern}" if tc.tokenizer_kind == "bpe" and tc.tokenizer_pattern != "gpt4" else ""
    return Path("data") / f"{name}-{tc.tokenizer_kind}-{tc.tokenizer_vocab_size}{suffix}"


def prepare_data(
    tc: TrainConfig, tokenizer: Tokenizer | None = None, log: Callable[[str], None] = print, *,
    reuse_only: bool = False,
) -> ShardSet:
    """The token shards training reads: prepared once into the data folder, reused after.

    The tokenizer is ``tokenizer`` if given (resuming, or starting from another run), else the
    file ``tc.tokenizer``, else the one already in the data folder if it is of the configured
    kind and size, else one trained on the corpus now. ``reuse_only``: the folder was named by a
    file (a run's run.json), not by the user, so it is only read, never written.
    """
    corpus = load_corpus(tc.corpus, glob=tc.glob, text_field=tc.text_field, errors=tc.errors, encoding=tc.encoding)
    if tokenizer is None and tc.tokenizer is not None:
        tokenizer = load_tokenizer(tc.tokenizer)
    data_dir = Path(tc.data_dir) if tc.data_dir else default_data_dir(tc, corpus.name, tokenizer)
    if reuse_only:
        return _prepare(corpus, tc, tokenizer, data_dir, log, reuse_only=True)
    # one process prepares a data folder at a time; a second run wanting the same shards waits, then reuses them
    with folder_lock(data_dir, "prepare", wait=log):
        return _prepare(corpus, tc, tokenizer, data_dir, log, reuse_only=False)


def _prepare(corpus: Corpus, tc: TrainConfig, tokenizer: Tokenizer | None, data_dir: Path,
             log: Callable[[str], None], *, reuse_only: bool) -> ShardSet:
    """`prepare_data` once the folder is settled (and locked, unless only read)."""
    existing = data_dir / TOKENIZER_FILE if (data_dir / META_FILE).exists() else None
    if tokenizer is None and existing is not None:
        candidate = load_tokenizer(existing)
        if _is_requested_tokenizer(candidate, tc):
            tokenizer = candidate
        elif _is_requested_tokenizer(candidate, tc, smaller=True):
            # the corpus could not fill the vocabulary asked for: reuse it if training again gives the same one
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "ran out of pairs to merge" was said when the data was made
                again = _train_tokenizer(corpus, tc)
            check_same_tokenizer(
                candidate, again, f"{data_dir} holds shards made with a {candidate.kind} tokenizer of "
                f"{candidate.vocab_size} tokens, and one trained on {corpus.name} now is another (has the corpus changed?)",
                "set --data-dir to another folder")
            tokenizer = candidate
        else:
            raise TinyLMError(
                f"{data_dir} holds shards made with a {candidate.kind} tokenizer of {candidate.vocab_size} tokens, "
                f"not the {tc.tokenizer_kind} tokenizer of {tc.tokenizer_vocab_size} asked for; "
                "set --data-dir to another folder"
            )
    if tokenizer is not None and existing is not None:
        check_same_tokenizer(ShardSet.open(data_dir).meta["tokenizer"]["fingerprint"], tokenizer,
                             f"{data_dir} holds shards made with another tokenizer than this run's",
                             "set --data-dir to another folder")
    if tokenizer is None:
        start = time.perf_counter()
        tokenizer = _train_tokenizer(corpus, tc)
        log(f"trained a {tokenizer.kind} tokenizer with |V| = {tokenizer.vocab_size} on {corpus.name} "
            f"in {time.perf_counter() - start:.1f}s")
    try:
        shards = prepare(corpus, tokenizer, data_dir, val_fraction=tc.val_fraction, progress=_stderr_is_terminal(),
                         reuse_only=reuse_only)
    except TinyLMError as e:
        # prepare's advice is for `tinylm prepare`; train's --force deletes the run, not the shards
        raise TinyLMError(str(e).replace("choose another output folder or pass --force",
                                         "set --data-dir to another folder")) from None
    if shards.num_tokens("train") == 0 or shards.num_tokens("val") == 0:
        raise TinyLMError(f"corpus {corpus.name!r} is too small to give both a training and a validation split")
    return shards


def default_prepare_dir(corpus_name: str) -> Path:
    """data/<corpus>: where `prepare_corpus` (`tinylm prepare`) writes when no folder is named."""
    return Path("data") / corpus_stem(corpus_name)


def prepare_corpus(
    corpus: str | os.PathLike | Corpus,
    out: str | os.PathLike | None = None,
    *,
    tokenizer: str | os.PathLike | Tokenizer | None = None,
    kind: str = "bpe",
    vocab_size: int | None = 4096,
    pattern: str = "gpt4",
    unknown: str = "unk",
    n_reserved: int = 0,
    val_fraction: float = 0.1,
    seed: int = 0,
    workers: int | None = None,
    force: bool = False,
    log: Callable[[str], None] = print,
) -> ShardSet:
    """`tinylm prepare`: ``corpus`` (a name or path, as for `load_corpus`, or a `Corpus`) into train/validation
    token shards in ``out``, by default `default_prepare_dir` (data/<corpus>).

    The tokenizer is ``tokenizer`` (a tinylm tokenizer file, or a `Tokenizer`) if given; else the one a
    prepare left in the folder, whatever its kind and size, unless ``force``; else one trained on the corpus
    now (``kind``, ``vocab_size``, ``pattern``, ``unknown``, ``n_reserved``: see `train_tokenizer`) and saved
    in the folder before the shards are written, so that a prepare stopped part way reuses it. ``force``
    also rewrites shards of other text, tokenizer or split (``val_fraction``, ``seed``), which are
    otherwise refused; the same ones are reused. A folder holding files prepare did not write is refused
    before anything is trained, ``force`` or not, and so is one another tinylm process is writing.
    ``workers``: processes for training the tokenizer and encoding (None: every core). ``log`` gets one
    line on the tokenizer (reused or trained) and one on the shards (reused, or written in how long).
    """
    if not 0 < val_fraction < 1:
        raise TinyLMError(f"val_fraction must be strictly between 0 and 1 (training needs a validation split), "
                          f"got {val_fraction}")
    if not isinstance(corpus, Corpus):
        corpus = load_corpus(corpus)
    out = Path(out) if out is not None else default_prepare_dir(corpus.name)
    check_output_folder(out)  # before the lock makes the folder, and before a tokenizer is trained and saved there

    def train() -> Tokenizer:
        return train_tokenizer(kind, corpus.texts(), vocab_size=vocab_size, pattern=pattern, unknown=unknown,
                               n_reserved=n_reserved, workers=workers, progress=_stderr_is_terminal())

    with folder_lock(out, "prepare"):
        tok = _prepare_tokenizer(out, tokenizer, force, train, log)
        start = time.perf_counter()
        shards = prepare(corpus, tok, out, val_fraction=val_fraction, seed=seed, workers=workers,
                         progress=_stderr_is_terminal(), overwrite=force)
        seconds = time.perf_counter() - start
    log(f"{'reused' if shards.reused else f'wrote in {seconds:.1f}s'}: token shards in {out}")
    return shards


def _prepare_tokenizer(out: Path, tokenizer: str | os.PathLike | Tokenizer | None, force: bool,
                       train: Callable[[], Tokenizer], log: Callable[[str], None]) -> Tokenizer:
    """`prepare_corpus`'s tokenizer: the one given, the one left in ``out`` (unless ``force``), or one trained now
    (``train``) and saved in ``out``."""
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    if tokenizer is not None:
        return load_tokenizer(tokenizer)
    path = out / TOKENIZER_FILE
    if path.exists() and not force:
        log(f"reusing the tokenizer in {path} (pass --force to train a new one)")
        return load_tokenizer(path)
    start = time.perf_counter()
    tok = train()
    tok.save(path)
    log(f"trained a {tok.kind} tokenizer with |V| = {tok.vocab_size} in {time.perf_counter() - start:.1f}s: {path}")
    return tok


def _is_requested_tokenizer(tok: Tokenizer, tc: TrainConfig, smaller: bool = False) -> bool:
    """Whether ``tok`` is of the kind, pattern and size ``tc`` asks for (``smaller``: of fewer tokens than asked)."""
    if tok.kind != tc.tokenizer_kind:
        return False
    if tok.kind == "char":
        return not smaller
    if tok.kind == "bpe":
        if tok.pattern != resolve_pattern(tc.tokenizer_pattern):
            return False
    return tok.vocab_size < tc.tokenizer_vocab_size if smaller else tok.vocab_size == tc.tokenizer_vocab_size


def _train_tokenizer(corpus: Corpus, tc: TrainConfig) -> Tokenizer:
    return train_tokenizer(tc.tokenizer_kind, corpus.texts(), vocab_size=tc.tokenizer_vocab_size,
                           pattern=tc.tokenizer_pattern, progress=_stderr_is_terminal())


def _stderr_is_terminal() -> bool:
    return sys.stderr is not None and sys.stderr.isatty()
