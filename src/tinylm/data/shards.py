"""Token shards: a corpus tokenized once into flat binary files, and training windows read from them.

`prepare` turns a `Corpus` into a folder that training and evaluation read directly::

    shards = prepare(load_corpus("shakespeare"), tokenizer, "data/shakespeare-char")
    x, y = shards.sample_windows("train", batch_size=32, block_size=256, generator=0)
    for x, y in shards.iter_windows("val", batch_size=32, block_size=256): ...

The folder holds:

- ``train.bin`` and ``val.bin``: every document's token ids followed by the end-of-sequence
  token, documents back to back, as raw ``uint16`` (when |V| <= 65536) or ``uint32``, no header,
  so ``np.memmap`` can read any window without loading the file. Documents are encoded with
  `Tokenizer.encode_ordinary`, so a document containing the text ``<|eos|>`` cannot fake a
  document boundary: the EOS ids in a shard are exactly the document ends.
- ``tokenizer.json``: the tokenizer the ids belong to.
- ``meta.json``: what was made and from what (format version, tokenizer kind, size and
  fingerprint, dtype, per split the number of documents, tokens and UTF-8 bytes of original
  text, corpus name, split parameters and a fingerprint of the input text). The bytes count is
  what bits per byte divides by.

The split is by document, never through one: each document gets a key, the first 8 bytes of
``sha256(seed, index, name)``, and the ``round(n * val_fraction)`` documents with the smallest
keys form the validation split (at least one, and at least one left for training, whenever
``val_fraction > 0``). Fixing the count instead of thresholding each key keeps a small corpus
(Shakespeare's 42 plays and poems) from getting a validation split of none or of many. A corpus of
a single document is cut in two at the line boundary nearest ``1 - val_fraction`` of its
characters (at that character if it has no line break): the head trains, the tail validates,
each piece ending with its own EOS.

Preparing reads the corpus twice: once to fingerprint it and plan the split, once to tokenize
it (checking that the fingerprint has not changed meanwhile). Tokenizing runs in a pool of
processes, one batch of documents at a time, with at most a few batches in flight, so memory
stays bounded whatever the corpus size. Files are written under temporary names and renamed
into place with meta.json last, so an interrupted run never leaves a folder that looks complete;
a full or read-only disk is one line, with the temporary files gone. The workers end with the
process that started them, even one killed outright.
Running `prepare` again with the same text, tokenizer and split parameters reuses the folder
(``ShardSet.reused`` is true); anything else there is an error unless ``overwrite=True``.

Reading trusts nothing it has not checked: `ShardSet.open` refuses a meta.json whose file names
leave the folder or whose dtype is not the one tinylm writes for its vocabulary, and the first
read of a split refuses ids past the vocabulary, each as one line.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import tempfile
from array import array
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from tinylm.atomic import disk_writes
from tinylm.data.corpora import Corpus
from tinylm.errors import TinyLMError
from tinylm.jsonfile import JSONFormat
from tinylm.lock import LOCK_FILE
from tinylm.tokenizers.base import FORMAT_NAME as TOKENIZER_FORMAT
from tinylm.tokenizers.base import Tokenizer, check_same_tokenizer, load_tokenizer, tokenizer_from_dict
from tinylm.workers import alive, in_order

SHARDS_FILE = JSONFormat(  # meta.json
    "tinylm.shards", 1,
    missing="{folder} has no {file}: it is not a prepared shard folder (or a prepare was interrupted); "
            "run `tinylm prepare` into it",
    unreadable="{path} is unreadable ({error}); choose another output folder",
    foreign="{path} is not a tinylm shard description; choose another output folder",
    wrong_version="{folder} holds shards of format version {found!r}, but this tinylm reads version {version}; "
                  "prepare them again with --force",
)
FORMAT_NAME = SHARDS_FILE.name
SPLITS = ("train", "val")
META_FILE = "meta.json"
TOKENIZER_FILE = "tokenizer.json"

# Below this much text a process pool costs more to start than it saves.
_SERIAL_BELOW_BYTES = 1 << 20
# A batch sent to a worker: enough text to amortise the inter-process copy, small enough
# that a few batches in flight per worker keep memory bounded.
_BATCH_DOCS = 256
_BATCH_CHARS = 1 << 20


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds every id: uint16 up to 65536 tokens, else uint32."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


# ----- planning: fingerprint and split ------------------------------------------------------------


def _hash_document(h: Any, name: str, data: bytes) -> None:
    # length-prefixed, so no two different document lists hash the same byte stream
    name_bytes = name.encode("utf-8")
    h.update(len(name_bytes).to_bytes(8, "little") + name_bytes + len(data).to_bytes(8, "little"))
    h.update(data)


def _split_key(seed: int, index: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}\0{index}\0{name}".encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big")


@dataclass
class _Plan:
    fingerprint: str
    n_documents: int
    n_bytes: int
    is_val: np.ndarray  # (n_documents,) bool; unused for a single cut document
    cut_single: bool  # one document, cut into a train head and a val tail


def _plan(corpus: Corpus, val_fraction: float, seed: int, progress: bool) -> _Plan:
    """Read the corpus once: its fingerprint, its size, and which documents validate."""
    h = hashlib.sha256()
    keys = array("Q")  # 8 bytes a document, so even millions of JSONL lines are cheap
    n_bytes = 0
    with tqdm(desc="reading", unit="B", unit_scale=True, disable=not progress) as bar:
        for i, doc in enumerate(corpus.documents()):
            data = doc.text.encode("utf-8")
            _hash_document(h, doc.name, data)
            keys.append(_split_key(seed, i, doc.name))
            n_bytes += len(data)
            bar.update(len(data))
    n = len(keys)
    is_val = np.zeros(n, dtype=bool)
    cut_single = n == 1 and val_fraction > 0
    if n >= 2 and val_fraction > 0:
        n_val = min(max(round(n * val_fraction), 1), n - 1)
        order = np.argsort(np.frombuffer(keys, dtype=np.uint64), kind="stable")
        is_val[order[:n_val]] = True
    return _Plan(h.hexdigest(), n, n_bytes, is_val, cut_single)


def _cut_point(text: str, train_fraction: float) -> int:
    """Where to cut a lone document: the line boundary nearest the target, else the target."""
    target = min(max(round(len(text) * train_fraction), 1), len(text) - 1)
    candidates = [text.rfind("\n", 0, target) + 1, text.find("\n", target) + 1]
    candidates = [c for c in candidates if 0 < c < len(text)]
    if not candidates:
        return target
    return min(candidates, key=lambda c: (abs(c - target), c))


def _pieces(corpus: Corpus, plan: _Plan, val_fraction: float) -> Iterator[tuple[str, str]]:
    """(split, text) for every piece to tokenize, re-checking the corpus fingerprint as it goes."""
    h = hashlib.sha256()
    for i, doc in enumerate(corpus.documents()):
        _hash_document(h, doc.name, doc.text.encode("utf-8"))
        if plan.cut_single:
            if len(doc.text) < 2:
                raise TinyLMError(
                    f"corpus {corpus.name!r} is one document of {len(doc.text)} character, too little to split "
                    "into train and validation; give more text or a validation fraction of 0"
                )
            cut = _cut_point(doc.text, 1 - val_fraction)
            yield "train", doc.text[:cut]
            yield "val", doc.text[cut:]
        else:
            yield ("val" if i < plan.n_documents and plan.is_val[i] else "train"), doc.text
    if h.hexdigest() != plan.fingerprint:
        raise TinyLMError(f"corpus {corpus.name!r} changed while it was being prepared; run prepare again")


def _batches(pieces: Iterator[tuple[str, str]]) -> Iterator[tuple[list[str], list[str]]]:
    splits: list[str] = []
    texts: list[str] = []
    chars = 0
    for split, text in pieces:
        splits.append(split)
        texts.append(text)
        chars += len(text)
        if len(texts) >= _BATCH_DOCS or chars >= _BATCH_CHARS:
            yield splits, texts
            splits, texts, chars = [], [], 0
    if texts:
        yield splits, texts


# ----- encoding, in this process or in workers ----------------------------------------------------


def _encode_texts(tokenizer: Tokenizer, texts: Sequence[str], dtype: np.dtype) -> list[np.ndarray]:
    """Each text's ids followed by EOS, as an array of the shard dtype."""
    out = []
    for text in texts:
        ids = tokenizer.encode_ordinary(text)
        arr = np.empty(len(ids) + 1, dtype=dtype)
        arr[:-1] = ids
        arr[-1] = tokenizer.eos_id
        out.append(arr)
    return out


# A worker process's tokenizer, rebuilt once from its dict by `_init_worker`: the pool's
# initializer can only hand state to the tasks through the worker's globals. The dict, not the
# object, crosses the process boundary, because a tokenizer may cache unpicklable helpers.
_worker: dict[str, Any] = {}


def _init_worker(tokenizer_dict: dict[str, Any], dtype: str) -> None:
    _worker["tokenizer"] = tokenizer_from_dict(tokenizer_dict)
    _worker["dtype"] = np.dtype(dtype)


def _encode_in_worker(batch: tuple[list[str], list[str]]) -> list[np.ndarray]:
    """A batch's (splits, texts) to the texts' arrays, in a worker."""
    texts = batch[1]
    try:
        return _encode_texts(_worker["tokenizer"], texts, _worker["dtype"])
    except TinyLMError:
        raise
    except BaseException as e:  # whatever it was, it must reach the parent as an error, not kill the worker
        raise TinyLMError(f"a tokenizing worker failed: {type(e).__name__}: {e}") from None


def _encoded(
    batches: Iterator[tuple[list[str], list[str]]], tokenizer: Tokenizer, dtype: np.dtype, workers: int
) -> Iterator[tuple[list[str], list[str], list[np.ndarray]]]:
    """(splits, texts, arrays) per batch, in corpus order."""
    if workers <= 1:
        for splits, texts in batches:
            yield splits, texts, _encode_texts(tokenizer, texts, dtype)
        return
    work = in_order(_encode_in_worker, batches, workers=workers, died="a tokenizing worker process died",
                    initializer=_init_worker, initargs=(tokenizer.to_dict(), dtype.str))
    for (splits, texts), arrays in work:
        yield splits, texts, arrays


# ----- prepare ------------------------------------------------------------------------------------


def prepare(
    corpus: Corpus,
    tokenizer: Tokenizer,
    out_dir: str | os.PathLike,
    *,
    val_fraction: float = 0.1,
    seed: int = 0,
    workers: int | None = None,
    progress: bool = False,
    overwrite: bool = False,
    reuse_only: bool = False,
) -> ShardSet:
    """Tokenize ``corpus`` into train/val shards in ``out_dir`` (see the module docstring).

    ``val_fraction`` (0 <= f < 1) is the share of documents that validate; 0 makes no
    validation split. ``seed`` picks which documents. ``workers`` is the number of encoding
    processes: None uses every available core (one, for less than 1 MB of text); 1 encodes
    in this process. ``progress`` shows progress bars on stderr. If ``out_dir`` already holds
    shards of the same text, tokenizer and split, they are returned with ``reused`` set;
    shards of anything else raise `TinyLMError` unless ``overwrite`` is true. ``reuse_only``
    writes nothing: the folder must already hold these shards (for a folder named by a file
    read from disk, such as a run's run.json, rather than by the user). A folder holding files
    prepare did not write is refused, ``overwrite`` or not.
    """
    _check_arguments(val_fraction, workers)
    out = Path(out_dir)
    check_output_folder(out)
    existing = None if overwrite else _shards_of_same_recipe(out, tokenizer, val_fraction, seed)
    plan = _plan(corpus, val_fraction, seed, progress)
    if existing is not None:
        return _reuse(existing, plan, out)
    if reuse_only:
        raise TinyLMError(f"{out} does not hold finished shards of corpus {corpus.name!r}, and tinylm writes only "
                          "where you name it: pass --data-dir with a folder to prepare them in")
    _remove_stale_temporaries(out)

    dtype = token_dtype(tokenizer.vocab_size)
    workers = _worker_count(workers, plan)
    # a full or read-only disk: one line, the temporary files gone, finished shards already there untouched
    with disk_writes(f"token shards in {out}", lambda: _intact(out)):
        out.mkdir(parents=True, exist_ok=True)
        with _staging(out) as (temps, shard_files):
            encoded = _encoded(_batches(_pieces(corpus, plan, val_fraction)), tokenizer, dtype, workers)
            stats = _write_shards(encoded, shard_files, plan.n_bytes, progress)
            _sync_and_close(shard_files)
            meta = _meta(corpus, plan, tokenizer, dtype, val_fraction, seed, stats)
            _stage_tokenizer_and_meta(out, temps, tokenizer, meta)
            _move_into_place(out, temps)
    return ShardSet.open(out)


def _check_arguments(val_fraction: float, workers: int | None) -> None:
    if not 0 <= val_fraction < 1:
        raise TinyLMError(f"the validation fraction must be at least 0 and below 1, got {val_fraction}")
    if workers is not None and workers < 1:
        raise TinyLMError(f"workers must be 1 or more, got {workers}")


def _shards_of_same_recipe(out: Path, tokenizer: Tokenizer, val_fraction: float, seed: int) -> ShardSet | None:
    """The shards already in ``out``, if any, after checking they were made with this tokenizer and split."""
    if not (out / META_FILE).exists():
        return None
    existing = ShardSet.open(out)
    _check_same_recipe(existing, tokenizer, val_fraction, seed)
    return existing


def _reuse(existing: ShardSet, plan: _Plan, out: Path) -> ShardSet:
    """The existing shards, marked reused, if they were made from the same text; else an error."""
    if existing.meta["input_fingerprint"] == plan.fingerprint:
        existing.reused = True
        return existing
    raise TinyLMError(
        f"{out} already holds shards of different text (corpus {existing.meta['corpus']!r}); "
        "choose another output folder or pass --force"
    )


def _worker_count(workers: int | None, plan: _Plan) -> int:
    """The number of encoding processes asked for, or by default: one for little text, else every core."""
    if workers is not None:
        return workers
    from tinylm.device import available_cpus  # here: tokenizing needs no torch, which tinylm.device imports

    return 1 if plan.n_bytes < _SERIAL_BELOW_BYTES else available_cpus()


@contextlib.contextmanager
def _staging(out: Path) -> Iterator[tuple[dict[str, Path], dict[str, Any]]]:
    """(temporary paths, open shard files): a temporary file in ``out`` per split, open for writing.

    Every file still in the paths when the block ends, by an error or not, is closed and removed;
    `_move_into_place` takes out those it renames.
    """
    temps: dict[str, Path] = {}
    shard_files: dict[str, Any] = {}
    try:
        for split in SPLITS:
            fd, name = tempfile.mkstemp(prefix=f".{split}.bin.{os.getpid()}.", suffix=".tmp", dir=out)
            os.chmod(fd, 0o644)  # mkstemp makes the file private; shards are ordinary data
            temps[split] = Path(name)
            shard_files[split] = os.fdopen(fd, "wb")
        yield temps, shard_files
    finally:
        for f in shard_files.values():
            with contextlib.suppress(OSError):  # a full disk fails the last flush again: the file goes anyway
                f.close()
        for path in temps.values():
            path.unlink(missing_ok=True)


def _write_shards(
    encoded: Generator[tuple[list[str], list[str], list[np.ndarray]], None, None],
    shard_files: dict[str, Any],
    n_bytes: int,
    progress: bool,
) -> dict[str, dict[str, Any]]:
    """Append each encoded piece to its split's file; per split, the file name and the documents,
    tokens and UTF-8 bytes of text written."""
    stats = {split: {"file": f"{split}.bin", "documents": 0, "tokens": 0, "bytes": 0} for split in SPLITS}
    with tqdm(total=n_bytes, desc="tokenizing", unit="B", unit_scale=True, disable=not progress) as bar:
        # closing(): on an error here the pool inside the generator is shut down at once,
        # not whenever the traceback that still references the generator is freed
        with contextlib.closing(encoded):
            for splits, texts, arrays in encoded:
                for split, text, arr in zip(splits, texts, arrays):
                    arr.tofile(shard_files[split])
                    n_text_bytes = len(text.encode("utf-8"))
                    st = stats[split]
                    st["documents"] += 1
                    st["tokens"] += len(arr)
                    st["bytes"] += n_text_bytes
                    bar.update(n_text_bytes)
    return stats


def _sync_and_close(shard_files: dict[str, Any]) -> None:
    for f in shard_files.values():
        f.flush()
        os.fsync(f.fileno())
        f.close()


def _meta(
    corpus: Corpus,
    plan: _Plan,
    tokenizer: Tokenizer,
    dtype: np.dtype,
    val_fraction: float,
    seed: int,
    stats: dict[str, dict[str, Any]],
) -> dict[str, Any]:
    """meta.json's content: what was made and from what."""
    return {
        **SHARDS_FILE.header(),
        "corpus": corpus.name,
        "input_fingerprint": plan.fingerprint,
        "tokenizer": {
            "kind": tokenizer.kind,
            "fingerprint": tokenizer.fingerprint(),
            "vocab_size": tokenizer.vocab_size,
            "eos_id": tokenizer.eos_id,
            "file": TOKENIZER_FILE,
        },
        "dtype": dtype.name,
        "val_fraction": val_fraction,
        "seed": seed,
        "split_method": "single document cut at a line boundary" if plan.cut_single else "by document",
        "splits": stats,
        "skipped_documents": len(corpus.skipped),
    }


def _stage_tokenizer_and_meta(out: Path, temps: dict[str, Path], tokenizer: Tokenizer, meta: dict[str, Any]) -> None:
    """Write tokenizer.json and meta.json under temporary names, adding them to ``temps``."""
    temps["tokenizer"] = tokenizer.save(out / f".{TOKENIZER_FILE}.{os.getpid()}.tmp")
    temps["meta"] = out / f".{META_FILE}.{os.getpid()}.tmp"
    temps["meta"].write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")


def _move_into_place(out: Path, temps: dict[str, Path]) -> None:
    """Rename the temporary files to their names, meta.json last, taking each out of ``temps``."""
    # Unmark the folder first: between here and the last rename it must not look complete.
    (out / META_FILE).unlink(missing_ok=True)
    for split in SPLITS:
        os.replace(temps.pop(split), out / f"{split}.bin")
    os.replace(temps.pop("tokenizer"), out / TOKENIZER_FILE)
    os.replace(temps.pop("meta"), out / META_FILE)


SHARD_FILES = ("train.bin", "val.bin", TOKENIZER_FILE, META_FILE)
# What prepare writes before renaming into place: ".<file>.<pid>.<random>.tmp" or ".<file>.<pid>.tmp"
_TEMPORARY = re.compile(r"\.(?:train\.bin|val\.bin|tokenizer\.json|meta\.json)\.(\d+)(?:\.[^.]+)?\.tmp")


def _intact(out: Path) -> str:
    """What a failed prepare left in ``out``: the shards finished there before, or nothing of its own."""
    if (out / META_FILE).is_file():
        return "the shards there before are intact"
    return "nothing half-written is left there"


def check_output_folder(out: Path) -> None:
    """Refuse a shard folder holding anything prepare did not write: it never replaces another tool's files.

    The folder may be new or empty, or hold shards (finished or interrupted) and a tinylm tokenizer.
    """
    if out.exists() and not out.is_dir():
        raise TinyLMError(f"output folder {out} is a file; choose a folder for the shards")
    if not out.is_dir():
        return
    foreign = sorted(p.name for p in out.iterdir()
                     if p.name not in SHARD_FILES and p.name != LOCK_FILE and not _TEMPORARY.fullmatch(p.name))
    if foreign:
        shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        what = "a run folder" if "run.json" in foreign else "a folder"
        raise TinyLMError(f"{out} is {what} holding files tinylm prepare did not write ({shown}); "
                          "give the shards a new or empty folder of their own")
    if _written_by_someone_else(out / META_FILE, FORMAT_NAME):
        raise TinyLMError(f"{out / META_FILE} was not written by tinylm prepare; choose another output folder")
    if _written_by_someone_else(out / TOKENIZER_FILE, TOKENIZER_FORMAT):
        raise TinyLMError(f"{out / TOKENIZER_FILE} was not written by tinylm; choose another output folder, "
                          "so that it is not replaced")


def _remove_stale_temporaries(out: Path) -> None:
    """Delete temporary files left by a prepare that was killed (their process is gone)."""
    if not out.is_dir():
        return
    for path in out.iterdir():
        m = _TEMPORARY.fullmatch(path.name)
        if m and not alive(int(m.group(1))):
            path.unlink(missing_ok=True)


def _written_by_someone_else(path: Path, format_name: str) -> bool:
    """A file there whose "format" is not ``format_name``: --force must not replace another tool's files."""
    if not path.exists():
        return False
    try:
        return json.loads(path.read_text(encoding="utf-8")).get("format") != format_name
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        return True  # ours are written atomically, so an unreadable one is someone else's


def _check_meta(folder: Path, meta: dict[str, Any]) -> None:
    """Refuse a meta.json that does not describe shards as `prepare` writes them, each way as one line.

    Its file names must be plain names inside ``folder`` (an edited ``"../../x"`` would read, and with
    --force replace, a file anywhere), and its dtype the one tinylm writes for its vocabulary: raw bytes
    read as another type (float16 is as long as uint16) are garbage, however well the sizes agree.
    """
    where = folder / META_FILE
    again = "prepare the shards again with --force"

    def refuse(what: str) -> TinyLMError:
        return TinyLMError(f"{where} is damaged or edited ({what}); {again}")

    tok = meta.get("tokenizer")
    if not isinstance(tok, dict):
        raise refuse("no tokenizer entry")
    vocab, eos = tok.get("vocab_size"), tok.get("eos_id")
    if not _is_count(vocab) or vocab < 1 or not _is_count(eos) or eos >= vocab:
        raise refuse(f"tokenizer vocab_size {vocab!r} and eos_id {eos!r} are not a vocabulary and an id in it")
    _check_file_name(where, "tokenizer file", tok.get("file"), again)
    splits = meta.get("splits")
    if not isinstance(splits, dict) or any(not isinstance(splits.get(split), dict) for split in SPLITS):
        raise refuse(f"it does not describe both splits, {' and '.join(SPLITS)}")
    for split in SPLITS:
        _check_file_name(where, f"{split} file", splits[split].get("file"), again)
        if not _is_count(splits[split].get("tokens")):
            raise refuse(f"the {split} token count {splits[split].get('tokens')!r} is not a count")
    expected = token_dtype(vocab).name
    if meta.get("dtype") != expected:
        raise TinyLMError(f"{where} says the token ids are {meta.get('dtype')!r}, but tinylm writes the ids of a "
                          f"{vocab}-token vocabulary as {expected}, and reading them as anything else gives garbage; "
                          f"{again}")


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_file_name(where: Path, what: str, name: Any, again: str) -> None:
    """A file named in meta.json must be a plain name of a file in its own folder."""
    if not isinstance(name, str) or not name or name in (".", "..") or Path(name).name != name or "\\" in name:
        raise TinyLMError(f"{where} names {name!r} as its {what}, which is not a file in that folder "
                          f"(shard files never leave it); {again}")


def _check_same_recipe(existing: ShardSet, tokenizer: Tokenizer, val_fraction: float, seed: int) -> None:
    """The cheap half of the reuse check, done before reading the corpus."""
    meta = existing.meta
    tok = meta["tokenizer"]
    check_same_tokenizer(tok["fingerprint"], tokenizer, f"{existing.path} already holds shards made with another "
                         f"tokenizer ({tok['kind']}, {tok['vocab_size']} tokens)", "choose another output folder or pass --force")
    if meta["val_fraction"] != val_fraction or meta["seed"] != seed:
        raise TinyLMError(
            f"{existing.path} already holds shards split with val_fraction={meta['val_fraction']}, "
            f"seed={meta['seed']}; choose another output folder or pass --force"
        )


# ----- reading shards back ------------------------------------------------------------------------


class ShardSet:
    """A prepared shard folder: its meta, its token arrays, and windows drawn from them."""

    def __init__(self, path: Path, meta: dict[str, Any], *, reused: bool = False) -> None:
        self.path = path
        self.meta = meta
        self.reused = reused
        """True when `prepare` found these shards already made and did not tokenize again."""
        self._tokens: dict[str, np.ndarray] = {}
        self._tokenizer: Tokenizer | None = None

    @classmethod
    def open(cls, path: str | os.PathLike) -> ShardSet:
        """Open a folder written by `prepare`, checking its format and file sizes."""
        path = Path(path)
        meta = SHARDS_FILE.read(path / META_FILE)
        _check_meta(path, meta)
        shards = cls(path, meta)
        for split in SPLITS:
            file = path / meta["splits"][split]["file"]
            expected = meta["splits"][split]["tokens"] * shards.dtype.itemsize
            actual = file.stat().st_size if file.exists() else None
            if actual != expected:
                raise TinyLMError(
                    f"{file} should hold {expected} bytes but {'is missing' if actual is None else f'has {actual}'}; "
                    "prepare the shards again with --force"
                )
        return shards

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.meta["dtype"])

    @property
    def vocab_size(self) -> int:
        return int(self.meta["tokenizer"]["vocab_size"])

    @property
    def eos_id(self) -> int:
        return int(self.meta["tokenizer"]["eos_id"])

    def tokenizer(self) -> Tokenizer:
        """The tokenizer whose ids these shards hold (read once; every evaluation asks for it)."""
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.path / self.meta["tokenizer"]["file"])
        return self._tokenizer

    def num_tokens(self, split: str) -> int:
        return int(self._split_meta(split)["tokens"])

    def _split_meta(self, split: str) -> dict[str, Any]:
        if split not in SPLITS:
            raise TinyLMError(f"unknown split {split!r}; the splits are {', '.join(SPLITS)}")
        return self.meta["splits"][split]

    def tokens(self, split: str) -> np.ndarray:
        """The split's token ids as a read-only memmap (an empty array for an empty split)."""
        if split not in self._tokens:
            meta = self._split_meta(split)
            if meta["tokens"] == 0:  # an empty file cannot be memory-mapped
                self._tokens[split] = np.empty(0, dtype=self.dtype)
            else:
                data = np.memmap(self.path / meta["file"], dtype=self.dtype, mode="r")
                self._check_ids(data, self.path / meta["file"])
                self._tokens[split] = data
        return self._tokens[split]

    def _check_ids(self, data: np.ndarray, file: Path) -> None:
        """Refuse a shard holding an id its tokenizer does not have: the model's embedding has no row for it,
        so it would be an index error deep in a training step (a file damaged, or swapped in from other shards).

        One pass over the file, once per process; every later read of it comes from the page cache.
        """
        if np.iinfo(data.dtype).max < self.vocab_size:
            return  # every value of the dtype is an id
        largest = int(data.max())
        if largest >= self.vocab_size:
            raise TinyLMError(f"{file} holds token id {largest}, but its tokenizer has {self.vocab_size} tokens "
                              f"(ids 0 to {self.vocab_size - 1}): the file is damaged or not from these shards; "
                              "prepare the shards again with --force")

    def _check_room(self, split: str, block_size: int, batch_size: int) -> np.ndarray:
        if block_size < 1 or batch_size < 1:
            raise TinyLMError(f"block size and batch size must be 1 or more, got {block_size} and {batch_size}")
        data = self.tokens(split)
        if len(data) < block_size + 1:
            raise TinyLMError(
                f"the {split} split has {len(data)} tokens, fewer than block size + 1 = {block_size + 1}; "
                "use a smaller block size, or more text (or a larger validation fraction)"
            )
        return data

    def sample_windows(
        self,
        split: str,
        batch_size: int,
        block_size: int,
        generator: np.random.Generator | int | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """A batch of packed windows at random offsets: x and y, both (batch_size, block_size) int64.

        ``y[b, t] = x[b, t+1]`` within the stream, i.e. y is x shifted one token left: the
        next-token targets. Windows may cross document boundaries (the EOS between them is a
        token the model learns to predict). ``generator`` is a numpy Generator, or a seed for a
        fresh one (the same seed gives the same batch).
        """
        data = self._check_room(split, block_size, batch_size)
        rng = generator if isinstance(generator, np.random.Generator) else np.random.default_rng(generator)
        starts = rng.integers(0, len(data) - block_size, size=batch_size)  # start + block_size < len
        window = data[starts[:, None] + np.arange(block_size + 1)].astype(np.int64)  # (B, T+1)
        return window[:, :-1], window[:, 1:]

    def iter_windows(self, split: str, batch_size: int, block_size: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Consecutive non-overlapping windows in order, for evaluation: (x, y) int64 batches.

        Window k holds x = tokens[k T : (k+1) T] and y = tokens[k T + 1 : (k+1) T + 1], so every
        token after the first is a target exactly once, except a tail shorter than one window,
        which is left out. The last batch may have fewer than ``batch_size`` rows.
        """
        data = self._check_room(split, block_size, batch_size)
        n_windows = (len(data) - 1) // block_size
        for first in range(0, n_windows, batch_size):
            last = min(first + batch_size, n_windows)
            x = np.asarray(data[first * block_size : last * block_size], dtype=np.int64)
            y = np.asarray(data[first * block_size + 1 : last * block_size + 1], dtype=np.int64)
            yield x.reshape(-1, block_size), y.reshape(-1, block_size)

    def __repr__(self) -> str:
        counts = ", ".join(f"{s}={self.num_tokens(s)}" for s in SPLITS)
        return f"ShardSet({str(self.path)!r}, {counts} tokens, {self.meta['dtype']})"
