"""Hostile text through the data path: every `prepare` ends, with shards or with one clear line.

A file with a run of a million spaces used to hang `tinylm prepare` forever: tiktoken panicked
inside a pool worker (a BaseException, which multiprocessing.Pool does not report), the worker
died and the parent waited for its result. These tests run the real command on such files, make
workers fail on purpose, and fuzz `prepare` with files of long whitespace runs of every class,
NULs, invalid UTF-8 and huge lines, under a watchdog that fails the test instead of hanging.
"""

from __future__ import annotations

import faulthandler
import functools
import os
import subprocess
import sys

import numpy as np
import regex
import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from tinylm.data import Corpus, Document, ShardSet, load_corpus, prepare
from tinylm.data import shards as shards_module
from tinylm.errors import TinyLMError
from tinylm.tokenizers import CharTokenizer, WordTokenizer, train_bpe

SEED_TEXT = "First Citizen:\nBefore we proceed any further, hear me speak.\n    indented\tand\ttabbed\n\n" * 30


def tinylm(*args: str, cwd=None, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tinylm", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=timeout)


@pytest.fixture(scope="module")
def bpe():
    return train_bpe([SEED_TEXT], 300, workers=1)


def decoded_documents(shards: ShardSet, split: str) -> list[str]:
    tok = shards.tokenizer()
    ids = np.asarray(shards.tokens(split))
    ends = np.flatnonzero(ids == tok.eos_id)
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [tok.decode(ids[s:e]) for s, e in zip(starts, ends)]


@pytest.mark.slow
def test_prepare_and_encode_a_file_with_a_million_spaces(tmp_path, bpe):
    # More than 1 MB of text, so prepare tokenizes in a pool of worker processes, as it did when it hung.
    text = "It begins.\n" + " " * 999_999 + "x\n" + "\t" * 1_000_000 + "y\n" + "\u3000" * 400_000 + "z\n"
    folder = tmp_path / "docs"
    folder.mkdir()
    for i in range(4):
        (folder / f"doc{i}.txt").write_text(f"document {i}\n" + text, encoding="utf-8")
    tok_path = tmp_path / "tok.json"
    bpe.save(tok_path)
    result = tinylm("prepare", "--corpus", str(folder), "--tokenizer", str(tok_path), "--out", str(tmp_path / "shards"),
                    "--workers", "2")
    assert result.returncode == 0, result.stderr
    shards = ShardSet.open(tmp_path / "shards")
    got = sorted(decoded_documents(shards, "train") + decoded_documents(shards, "val"))
    assert got == sorted(f"document {i}\n" + text for i in range(4))
    # the ids are the reference encoder's
    assert np.asarray(shards.tokens("val"))[:-1].tolist() == bpe.encode_reference(decoded_documents(shards, "val")[0])

    (tmp_path / "one.txt").write_text(text, encoding="utf-8")
    result = tinylm("tokenizer", "encode", "--tokenizer", str(tok_path), "--file", str(tmp_path / "one.txt"))
    assert result.returncode == 0, result.stderr
    assert [int(i) for i in result.stdout.split()] == bpe.encode_reference(text)


class _Boom(BaseException):
    """Stands for tiktoken's PanicException: a BaseException, not an Exception."""


def _raise_base_exception(tokenizer, texts, dtype):
    raise _Boom("the Rust side panicked")


def _die(tokenizer, texts, dtype):
    os._exit(3)  # a worker killed outright, as the out-of-memory killer would


_encode_in_worker = shards_module._encode_in_worker  # bound at import, so in a worker it is the real one


def _failing_worker(failure, batch):
    """The workers' own function, with the encoder under it replaced in the worker: workers are
    spawned, so they import `shards` afresh and a patch in this process never reaches them."""
    shards_module._encode_texts = failure
    return _encode_in_worker(batch)


def _big_corpus() -> Corpus:
    docs = [Document(f"d{i}", SEED_TEXT * 20) for i in range(6)]
    return Corpus("big", lambda corpus: iter(docs))


@pytest.mark.parametrize("failure,needle", [(_raise_base_exception, "_Boom: the Rust side panicked"),
                                            (_die, "worker process died")])
def test_a_failing_worker_ends_prepare_with_an_error(tmp_path, monkeypatch, failure, needle):
    # A hang fails the test: the watchdog dumps every thread's stack and exits.
    monkeypatch.setattr(shards_module, "_encode_in_worker", functools.partial(_failing_worker, failure))
    tok = CharTokenizer.train([SEED_TEXT])
    faulthandler.dump_traceback_later(120, exit=True)
    try:
        with pytest.raises(TinyLMError, match=needle):
            prepare(_big_corpus(), tok, tmp_path / "out", workers=2)
    finally:
        faulthandler.cancel_dump_traceback_later()
    assert not (tmp_path / "out" / "meta.json").exists()
    assert [p.name for p in (tmp_path / "out").iterdir()] == []  # no temporary files left behind


# ----- the fuzz test ------------------------------------------------------------------------------

WHITESPACE = [" ", "\t", "\n", "\r", "\r\n", "\x0b", "\x0c", "\x85", "\u00a0", "\u1680", "\u2000", "\u2028",
              "\u2029", "\u202f", "\u205f", "\u3000"]
LENGTHS = [1, 3, 100, 20_000, 1_100_000, 1_100_000]  # the last one twice: most files get a run that panicked tiktoken
piece = st.one_of(
    st.tuples(st.sampled_from(WHITESPACE), st.sampled_from(LENGTHS)).map(lambda t: (t[0] * t[1]).encode()),
    st.just(b"\x00" * 50),
    st.just(b"\xff\xfe bad \xc3\x28 utf-8 \xed\xa0\x80"),  # invalid bytes, a CESU surrogate
    st.just(b"x" * 300_000),  # a huge line
    st.sampled_from([b"word", b"Speak, speak.", "\u6771\u4eac".encode(), "\U0001f600".encode()]),
)
_WS_RUN = regex.compile(r"\s+")
files = st.lists(piece, min_size=1, max_size=6).map(b"".join)


@pytest.mark.slow
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.data_too_large])
@example(data=b"a" + b" " * 1_100_000 + b"x", errors="strict", kind="bpe")
@example(data="\u3000".encode() * 1_100_000 + b"\xff x", errors="replace", kind="word")
@example(data=b"\t" * 1_100_000 + b"\xff x", errors="strict", kind="char")
@given(data=files, errors=st.sampled_from(["strict", "replace", "ignore"]),
       kind=st.sampled_from(["bpe", "char", "word"]))
def test_fuzzed_files_through_prepare_end_with_shards_or_one_clear_line(tmp_path_factory, bpe, data, errors, kind):
    tmp = tmp_path_factory.mktemp("fuzz")
    path = tmp / "input.txt"
    path.write_bytes(data)
    faulthandler.dump_traceback_later(120, exit=True)
    try:
        try:
            corpus = load_corpus(str(path), errors=errors)
            text = "".join(corpus.texts())
            tok = {"bpe": lambda: bpe, "char": lambda: CharTokenizer.train([text] or ["x"]),
                   "word": lambda: WordTokenizer.train([text], 300, unknown="bytes")}[kind]()
            shards = prepare(corpus, tok, tmp / "shards", workers=2 if len(data) > 1 << 20 else 1, val_fraction=0)
        except TinyLMError as e:
            message = str(e)
            event("refused: invalid UTF-8" if "not valid UTF-8" in message else f"refused: {message[-40:]}")
            assert message and "\n" not in message
            # the only failures are the ones a user can act on: bad UTF-8 under strict, or no text at all
            assert ("not valid UTF-8" in message and errors == "strict") or "no text" in message or "empty" in message, message
            return
    finally:
        faulthandler.cancel_dump_traceback_later()
    event(f"shards, longest whitespace run {'>= 1M' if max(map(len, _WS_RUN.findall(text)), default=0) >= 1 << 20 else '< 1M'}")
    got = decoded_documents(shards, "train")
    assert got == [text]
