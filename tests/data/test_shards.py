"""Token shards: what `prepare` writes (counts, split, EOS, dtype), reuse and refusal, atomic
writes, and the windows read back."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from diskkit import fill, leftovers, read_only, small_disk

from tinylm.data import Corpus, Document, ShardSet, load_corpus, prepare, token_dtype
from tinylm.errors import TinyLMError
from tinylm.tokenizers import CharTokenizer, WordTokenizer

LINE = "All the world's a stage, and all the men and women merely players.\n"
DOCS = [Document(f"doc{i:02d}", f"Document number {i}.\n" + LINE * (i % 4 + 1)) for i in range(20)]
DOCS[3] = Document("doc03", "A document that says <|eos|> in its text, which stays plain text.\n")


def memory_corpus(docs: list[Document], name: str = "memory") -> Corpus:
    return Corpus(name, lambda corpus: iter(docs))


@pytest.fixture(scope="module")
def tok() -> CharTokenizer:
    return CharTokenizer.train(d.text for d in DOCS)


def split_documents(shards: ShardSet, split: str, tok) -> list[str]:
    """The texts of a split, recovered by cutting the token stream at every EOS."""
    ids = np.asarray(shards.tokens(split))
    ends = np.flatnonzero(ids == tok.eos_id)
    assert len(ids) == 0 or ends[-1] == len(ids) - 1  # every document, the last too, ends in EOS
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [tok.decode(ids[s:e]) for s, e in zip(starts, ends)]


def test_prepare_counts_and_contents(tmp_path, tok):
    shards = prepare(memory_corpus(DOCS), tok, tmp_path, workers=1)
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert meta["format"] == "tinylm.shards" and meta["corpus"] == "memory"
    assert meta["tokenizer"] == {
        "kind": "char", "fingerprint": tok.fingerprint(), "vocab_size": tok.vocab_size,
        "eos_id": tok.eos_id, "file": "tokenizer.json",
    }
    assert meta["dtype"] == "uint16" and shards.dtype == np.uint16

    train, val = split_documents(shards, "train", tok), split_documents(shards, "val", tok)
    # the split is by whole documents, in corpus order within each split, and covers them all
    assert sorted(train + val) == sorted(d.text for d in DOCS)
    assert train == [d.text for d in DOCS if d.text in train]
    assert len(val) == 2  # round(20 * 0.1)
    for split, texts in (("train", train), ("val", val)):
        expected_tokens = sum(len(tok.encode_ordinary(t)) + 1 for t in texts)  # + one EOS each
        assert meta["splits"][split] == {
            "file": f"{split}.bin",
            "documents": len(texts),
            "tokens": expected_tokens,
            "bytes": sum(len(t.encode("utf-8")) for t in texts),
        }
        assert (tmp_path / f"{split}.bin").stat().st_size == 2 * expected_tokens
    assert shards.tokenizer().fingerprint() == tok.fingerprint()
    assert not shards.reused
    assert sorted(p.name for p in tmp_path.iterdir()) == ["meta.json", "tokenizer.json", "train.bin", "val.bin"]


def test_document_text_cannot_fake_an_eos(tmp_path, tok):
    shards = prepare(memory_corpus(DOCS), tok, tmp_path, workers=1)
    n_eos = sum(int((np.asarray(shards.tokens(s)) == tok.eos_id).sum()) for s in ("train", "val"))
    assert n_eos == len(DOCS)


def test_split_is_deterministic_and_depends_on_the_seed(tmp_path, tok):
    a = prepare(memory_corpus(DOCS), tok, tmp_path / "a", workers=1)
    b = prepare(memory_corpus(DOCS), tok, tmp_path / "b", workers=1)
    assert (tmp_path / "a" / "train.bin").read_bytes() == (tmp_path / "b" / "train.bin").read_bytes()
    assert a.meta == b.meta
    val_sets = {
        tuple(split_documents(prepare(memory_corpus(DOCS), tok, tmp_path / f"s{seed}", seed=seed, workers=1), "val", tok))
        for seed in range(5)
    }
    assert len(val_sets) > 1


def test_worker_pool_gives_the_same_shards(tmp_path, tok):
    prepare(memory_corpus(DOCS), tok, tmp_path / "serial", workers=1)
    prepare(memory_corpus(DOCS), tok, tmp_path / "pool", workers=2)
    for name in ("train.bin", "val.bin", "meta.json"):
        assert (tmp_path / "serial" / name).read_bytes() == (tmp_path / "pool" / name).read_bytes()


@pytest.mark.parametrize("n_docs, val_fraction, n_val", [(2, 0.01, 1), (3, 0.99, 2), (42, 0.1, 4), (20, 0.0, 0)])
def test_both_splits_get_documents(tmp_path, tok, n_docs, val_fraction, n_val):
    docs = [Document(f"d{i}", f"document {i}\n") for i in range(n_docs)]
    shards = prepare(memory_corpus(docs), tok, tmp_path, val_fraction=val_fraction, workers=1)
    splits = shards.meta["splits"]
    assert splits["val"]["documents"] == n_val
    assert splits["train"]["documents"] == n_docs - n_val
    if val_fraction == 0:
        assert len(shards.tokens("val")) == 0
        with pytest.raises(TinyLMError, match="the val split has 0 tokens"):
            shards.sample_windows("val", 2, 4, 0)


def test_one_document_is_cut_at_a_line_boundary(tmp_path):
    text = "".join(f"line {i} of the only document\n" for i in range(100))
    path = tmp_path / "one.txt"
    path.write_text(text)
    tok = CharTokenizer.train(text)
    shards = prepare(load_corpus(path), tok, tmp_path / "out", workers=1)
    assert shards.meta["split_method"] == "single document cut at a line boundary"
    train, val = split_documents(shards, "train", tok), split_documents(shards, "val", tok)
    assert len(train) == len(val) == 1
    assert train[0] + val[0] == text and train[0].endswith("\n")
    assert len(val[0]) == pytest.approx(0.1 * len(text), abs=len("line 99 of the only document\n"))


def test_one_line_document_is_cut_at_a_character(tmp_path):
    tok = CharTokenizer.train("abcdefghij")
    shards = prepare(memory_corpus([Document("x", "abcdefghij")]), tok, tmp_path, workers=1)
    assert split_documents(shards, "train", tok) == ["abcdefghi"]
    assert split_documents(shards, "val", tok) == ["j"]


def test_rerun_reuses_without_tokenizing(tmp_path, tok):
    first = prepare(memory_corpus(DOCS), tok, tmp_path, workers=1)
    mtime = (tmp_path / "train.bin").stat().st_mtime_ns
    again = prepare(memory_corpus(DOCS), tok, tmp_path, workers=1)
    assert again.reused and not first.reused
    assert (tmp_path / "train.bin").stat().st_mtime_ns == mtime
    assert again.meta == first.meta


def test_different_recipe_in_same_folder_is_refused(tmp_path, tok):
    prepare(memory_corpus(DOCS), tok, tmp_path, workers=1)
    other_tok = CharTokenizer.train("".join(d.text for d in DOCS) + "λ")
    refusal = r"another tokenizer \(char, \d+ tokens.*choose another output folder or pass --force"
    with pytest.raises(TinyLMError, match=refusal):
        prepare(memory_corpus(DOCS), other_tok, tmp_path)
    with pytest.raises(TinyLMError, match="split with val_fraction=0.1, seed=0"):
        prepare(memory_corpus(DOCS), tok, tmp_path, seed=1)
    with pytest.raises(TinyLMError, match="different text"):
        prepare(memory_corpus(DOCS[:-1]), tok, tmp_path)
    shards = prepare(memory_corpus(DOCS), other_tok, tmp_path, overwrite=True, workers=1)
    assert not shards.reused and shards.meta["tokenizer"]["fingerprint"] == other_tok.fingerprint()
    assert ShardSet.open(tmp_path).meta == shards.meta


class FailingSecondRead:
    """A corpus that reads fine once (the planning pass) and fails half-way through the second."""

    def __init__(self, failure: Exception) -> None:
        self.reads = 0
        self.failure = failure
        self.corpus = Corpus("flaky", self.read)

    def read(self, corpus: Corpus) -> Iterator[Document]:
        self.reads += 1
        for i, doc in enumerate(DOCS):
            if self.reads == 2 and i == 10:
                raise self.failure
            yield doc


def test_interrupted_prepare_leaves_nothing_that_looks_complete(tmp_path, tok):
    with pytest.raises(KeyboardInterrupt):
        prepare(FailingSecondRead(KeyboardInterrupt()).corpus, tok, tmp_path, workers=1)
    assert list(tmp_path.iterdir()) == []  # temporary files removed, no meta.json
    with pytest.raises(TinyLMError, match="no meta.json"):
        ShardSet.open(tmp_path)


def test_interrupted_overwrite_keeps_the_old_shards(tmp_path, tok):
    old = prepare(memory_corpus(DOCS), tok, tmp_path, workers=1)
    old_train = (tmp_path / "train.bin").read_bytes()
    with pytest.raises(KeyboardInterrupt):
        prepare(FailingSecondRead(KeyboardInterrupt()).corpus, tok, tmp_path, overwrite=True, workers=1)
    assert ShardSet.open(tmp_path).meta == old.meta
    assert (tmp_path / "train.bin").read_bytes() == old_train
    assert sorted(p.name for p in tmp_path.iterdir()) == ["meta.json", "tokenizer.json", "train.bin", "val.bin"]


def test_corpus_changing_between_passes_is_an_error(tmp_path, tok):
    reads = []

    def read(corpus):
        reads.append(1)
        yield from DOCS if len(reads) == 1 else DOCS[:-1] + [Document("doc19", "edited meanwhile")]

    with pytest.raises(TinyLMError, match="changed while it was being prepared"):
        prepare(Corpus("moving", read), tok, tmp_path, workers=1)
    assert not (tmp_path / "meta.json").exists()


def test_open_rejects_damaged_folders(tmp_path, tok):
    prepare(memory_corpus(DOCS), tok, tmp_path, workers=1)
    with open(tmp_path / "val.bin", "r+b") as f:
        f.truncate(4)
    with pytest.raises(TinyLMError, match=r"val.bin should hold \d+ bytes but has 4"):
        ShardSet.open(tmp_path)
    (tmp_path / "meta.json").write_text('{"format": "tinylm.shards", "version": 99}')
    with pytest.raises(TinyLMError, match="format version 99"):
        ShardSet.open(tmp_path)


def test_overwrite_never_replaces_another_tools_folder(tmp_path, tok):
    (tmp_path / "meta.json").write_text('{"format": "some.other.tool"}')
    for overwrite in (False, True):
        with pytest.raises(TinyLMError, match="choose another output folder"):
            prepare(memory_corpus(DOCS), tok, tmp_path, overwrite=overwrite)
    assert (tmp_path / "meta.json").read_text() == '{"format": "some.other.tool"}'


def test_bad_arguments(tmp_path, tok):
    with pytest.raises(TinyLMError, match="validation fraction"):
        prepare(memory_corpus(DOCS), tok, tmp_path, val_fraction=1.0)
    with pytest.raises(TinyLMError, match="workers must be 1 or more"):
        prepare(memory_corpus(DOCS), tok, tmp_path, workers=0)


def test_dtype_choice():
    assert token_dtype(256) == np.uint16
    assert token_dtype(65536) == np.uint16  # ids 0..65535
    assert token_dtype(65537) == np.uint32


def test_large_vocabulary_shards_are_uint32(tmp_path):
    # 70,000 distinct four-letter words: a word vocabulary with ids past 65535
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = [a + b + c + d for a in letters for b in letters for c in letters for d in letters][:70_000]
    text = " ".join(words)
    tok = WordTokenizer.train(text, vocab_size=70_000)
    # (the last few words do not fit in the vocabulary, so the documents stop short of them)
    corpus = memory_corpus([Document("head", " ".join(words[:100])), Document("tail", " ".join(words[66_000:66_100]))])
    shards = prepare(corpus, tok, tmp_path, workers=1)
    assert shards.meta["dtype"] == "uint32" and shards.dtype == np.uint32
    ids = np.concatenate([shards.tokens("train"), shards.tokens("val")])
    assert ids.max() > 65535
    assert sorted(split_documents(shards, "train", tok) + split_documents(shards, "val", tok)) == sorted(
        d.text for d in corpus.documents()
    )


# ----- windows --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shards(tmp_path_factory, tok) -> ShardSet:
    return prepare(memory_corpus(DOCS), tok, tmp_path_factory.mktemp("shards"), workers=1)


def test_sample_windows(shards, tok):
    x, y = shards.sample_windows("train", batch_size=8, block_size=16, generator=0)
    assert x.shape == y.shape == (8, 16) and x.dtype == y.dtype == np.int64
    assert 0 <= x.min() and x.max() < tok.vocab_size
    # each row is a contiguous stretch of the shard, and y is x shifted by one token
    data = np.asarray(shards.tokens("train"), dtype=np.int64)
    windows = np.lib.stride_tricks.sliding_window_view(data, 17)
    for row_x, row_y in zip(x, y):
        full = np.concatenate([row_x, row_y[-1:]])
        assert (windows == full).all(axis=1).any()
        assert (row_y[:-1] == row_x[1:]).all()


def test_sample_windows_is_reproducible(shards):
    a = shards.sample_windows("train", 4, 8, generator=123)
    b = shards.sample_windows("train", 4, 8, generator=123)
    assert all((p == q).all() for p, q in zip(a, b))
    rng = np.random.default_rng(123)
    c = shards.sample_windows("train", 4, 8, generator=rng)
    d = shards.sample_windows("train", 4, 8, generator=rng)
    assert (c[0] == a[0]).all() and not (d[0] == c[0]).all()  # a Generator moves on


def test_sample_windows_reach_every_start(tmp_path):
    # 500 distinct characters: a window's first token says where it starts
    text = "".join(chr(0x4E00 + i) for i in range(500))
    tok = CharTokenizer.train(text)
    shards = prepare(memory_corpus([Document("d", text)]), tok, tmp_path, val_fraction=0.0, workers=1)
    x, y = shards.sample_windows("train", batch_size=20_000, block_size=4, generator=0)
    starts = x[:, 0] - tok.encode_ordinary(text[0])[0]
    # 501 tokens (with the EOS) hold windows of 4 + 1 starting at 0..496, and every one is drawn
    assert set(starts.tolist()) == set(range(497))
    assert (y[starts == 496, -1] == tok.eos_id).all()


def test_windows_need_enough_tokens(shards):
    n_val = shards.num_tokens("val")
    with pytest.raises(TinyLMError, match=f"the val split has {n_val} tokens, fewer than block size"):
        shards.sample_windows("val", 1, n_val, 0)
    with pytest.raises(TinyLMError, match="unknown split 'test'"):
        shards.tokens("test")


def test_iter_windows_covers_the_split_in_order(shards):
    data = np.asarray(shards.tokens("val"), dtype=np.int64)
    block = 7
    batches = list(shards.iter_windows("val", batch_size=5, block_size=block))
    n_windows = (len(data) - 1) // block
    assert [len(x) for x, _ in batches][:-1] == [5] * (len(batches) - 1)
    x = np.concatenate([b[0] for b in batches])
    y = np.concatenate([b[1] for b in batches])
    assert x.shape == (n_windows, block) and x.dtype == np.int64
    assert (x.ravel() == data[: n_windows * block]).all()
    assert (y.ravel() == data[1 : n_windows * block + 1]).all()


def test_whole_shakespeare(shakespeare_corpus, tmp_path):
    tok = CharTokenizer.train(shakespeare_corpus.texts())
    shards = prepare(shakespeare_corpus, tok, tmp_path, workers=2)
    splits = shards.meta["splits"]
    assert splits["train"]["documents"] + splits["val"]["documents"] == 42
    assert splits["val"]["documents"] == 4  # round(42 * 0.1)
    assert splits["train"]["bytes"] + splits["val"]["bytes"] == 5_057_198
    # character tokens: one per character, plus one EOS per document
    n_chars = sum(len(t) for t in shakespeare_corpus.texts())
    assert splits["train"]["tokens"] + splits["val"]["tokens"] == n_chars + 42


# ----- damaged or edited shard folders -------------------------------------------------------------


def edit_meta(folder, edit) -> None:
    meta = json.loads((folder / "meta.json").read_text())
    edit(meta)
    (folder / "meta.json").write_text(json.dumps(meta))


def test_token_ids_past_the_vocabulary_are_one_line(tmp_path, tok):
    prepare(memory_corpus(DOCS), tok, tmp_path, workers=1)
    ids = np.fromfile(tmp_path / "train.bin", dtype=np.uint16)
    ids[17] = tok.vocab_size + 3  # a damaged file, or one from other shards: the embedding has no such row
    ids.tofile(tmp_path / "train.bin")
    shards = ShardSet.open(tmp_path)
    with pytest.raises(TinyLMError, match=rf"train.bin holds token id {tok.vocab_size + 3}, but its tokenizer has "
                                          rf"{tok.vocab_size} tokens \(ids 0 to {tok.vocab_size - 1}\): the file is "
                                          "damaged or not from these shards; prepare the shards again with --force"):
        shards.sample_windows("train", 2, 8, 0)
    assert len(shards.tokens("val")) > 0  # the sound split reads as before


@pytest.mark.parametrize("dtype", ["float16", "int16", "uint32"])
def test_a_dtype_tinylm_does_not_write_is_refused(tmp_path, tok, dtype):
    prepare(memory_corpus(DOCS), tok, tmp_path, workers=1)
    edit_meta(tmp_path, lambda meta: meta.update(dtype=dtype))  # float16 and int16 even fit the file sizes
    with pytest.raises(TinyLMError, match=rf"meta.json says the token ids are '{dtype}', but tinylm writes the ids of "
                                          rf"a {tok.vocab_size}-token vocabulary as uint16"):
        ShardSet.open(tmp_path)


@pytest.mark.parametrize("entry", ["splits.train", "splits.val", "tokenizer"])
@pytest.mark.parametrize("name", ["../../x", "/etc/passwd", "sub/train.bin", 7])
def test_a_file_outside_the_folder_is_refused(tmp_path, tok, entry, name):
    folder = tmp_path / "a" / "b"
    prepare(memory_corpus(DOCS), tok, folder, workers=1)
    (tmp_path / "x").write_bytes((folder / "train.bin").read_bytes())  # there, and of the right size

    def point(meta):
        table = meta
        for key in entry.split("."):
            table = table[key]
        table["file"] = name

    edit_meta(folder, point)
    with pytest.raises(TinyLMError, match=rf"meta.json names {re.escape(repr(name))} as its \w+ file, which is not a "
                                          "file in that folder"):
        ShardSet.open(folder)


def test_a_meta_json_missing_its_parts_is_one_line(tmp_path, tok):
    prepare(memory_corpus(DOCS), tok, tmp_path, workers=1)
    edit_meta(tmp_path, lambda meta: meta["splits"].pop("val"))
    with pytest.raises(TinyLMError, match="meta.json is damaged or edited .it does not describe both splits"):
        ShardSet.open(tmp_path)
    edit_meta(tmp_path, lambda meta: meta.update(tokenizer={"vocab_size": "many"}))
    with pytest.raises(TinyLMError, match="meta.json is damaged or edited .tokenizer vocab_size 'many'"):
        ShardSet.open(tmp_path)


# ----- a full disk, and a prepare killed outright --------------------------------------------------


def test_prepare_on_a_full_disk_is_one_line_and_leaves_nothing(tmp_path, tok):
    with small_disk(tmp_path / "disk") as disk:
        fill(disk, leave=4096)  # room for a file or two, not for the shards
        out = disk / "data"
        with pytest.raises(TinyLMError) as e:
            prepare(memory_corpus(DOCS * 10), tok, out, workers=1)
        assert str(e.value) == (f"cannot write token shards in {out}: no space left on device; nothing half-written "
                                "is left there; free some space and try again")
        assert list(out.iterdir()) == []
        # over finished shards (--force): they stay as they were
        (disk / "filler").unlink()
        old = prepare(memory_corpus(DOCS), tok, out, workers=1)
        fill(disk, leave=4096)
        with pytest.raises(TinyLMError, match="; the shards there before are intact; free some space"):
            prepare(memory_corpus(DOCS * 10), tok, out, workers=1, overwrite=True)
        assert ShardSet.open(out).meta == old.meta and leftovers(out) == []


def test_prepare_on_a_read_only_disk_is_one_line(tmp_path, tok):
    with small_disk(tmp_path / "disk") as disk:
        read_only(disk)
        with pytest.raises(TinyLMError, match=f"cannot write token shards in {disk / 'data'}: the file system is "
                                              "read-only; nothing half-written is left there; make it writable"):
            prepare(memory_corpus(DOCS), tok, disk / "data", workers=1)


# `prepare` with a pool of two workers over a corpus whose second reading stops for good after the
# first batch has gone to the workers: the process stands still mid-tokenizing until it is killed.
STALLED_PREPARE = """
import sys, time
from tinylm.data.corpora import Corpus, Document
from tinylm.data.shards import prepare
from tinylm.tokenizers import load_tokenizer

reads = []
def documents(corpus):
    reads.append(1)
    for i in range(600):
        if len(reads) == 2 and i == 300:  # batch one (256 documents) is with the workers
            print("tokenizing", flush=True)
            time.sleep(600)
        yield Document(f"d{i}", "All the world's a stage.\\n" * 40)
prepare(Corpus("stalled", documents), load_tokenizer(sys.argv[1]), sys.argv[2], workers=2)
"""


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid``, from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_bytes().rpartition(b")")[2].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


def running(pid: int) -> bool:
    try:
        return (Path(f"/proc/{pid}/stat").read_bytes().rpartition(b")")[2].split()[0]) not in (b"Z", b"X")
    except OSError:
        return False


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the worker processes in /proc (Linux)")
def test_killing_prepare_outright_ends_its_tokenizing_workers(tmp_path, tok):
    tok.save(tmp_path / "tok.json")
    proc = subprocess.Popen([sys.executable, "-c", STALLED_PREPARE, str(tmp_path / "tok.json"), str(tmp_path / "out")],
                            stdout=subprocess.PIPE, text=True)
    workers: list[int] = []
    try:
        assert proc.stdout.readline() == "tokenizing\n"
        workers = children(proc.pid)
        assert len(workers) >= 2, workers
        proc.send_signal(signal.SIGKILL)  # nothing of it runs again: no finally, no pool shutdown
        proc.wait()
        # a worker still starting (a fresh interpreter importing tinylm: seconds on a busy machine)
        # looks for its parent as soon as it has started
        deadline = time.monotonic() + 60
        while any(running(w) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [w for w in workers if running(w)] == []  # not left waiting forever on the pool's queue
    finally:
        proc.kill()
        proc.wait()
        for w in workers:
            if running(w):
                os.kill(w, signal.SIGKILL)
