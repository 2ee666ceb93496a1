"""`prepare_corpus`, the function behind `tinylm prepare`: where the shards go and which tokenizer they use,
asked of the library directly (the command only parses its flags and prints the splits)."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest

from tinylm.cli import build_parser
from tinylm.data.prepare_run import default_prepare_dir, prepare_corpus
from tinylm.data.shards import TOKENIZER_FILE
from tinylm.errors import TinyLMError
from tinylm.lock import folder_lock
from tinylm.tokenizers import CharTokenizer, load_tokenizer

TEXT = "To be, or not to be, that is the question.\nWhether 'tis nobler in the mind to suffer.\n" * 6


@pytest.fixture
def corpus(tmp_path):
    folder = tmp_path / "notes"
    folder.mkdir()
    for i in range(4):
        (folder / f"{i}.txt").write_text(TEXT + f"note {i}\n", encoding="utf-8")
    return folder


def quiet(line: str) -> None:
    pass


def test_without_out_the_folder_is_data_and_the_corpus_stem(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": TEXT + str(i)}) + "\n" for i in range(4)))
    shards = prepare_corpus("docs.jsonl", kind="char", log=quiet)
    assert shards.path.resolve() == (tmp_path / "data" / "docs").resolve()
    assert default_prepare_dir("notes/") == default_prepare_dir("notes") == Path("data", "notes")


def test_a_tokenizer_left_in_the_folder_is_reused_whatever_is_asked_until_force(tmp_path, corpus):
    out = tmp_path / "shards"
    said: list[str] = []
    first = prepare_corpus(corpus, out, kind="char", log=said.append)
    assert first.tokenizer().kind == "char" and not first.reused
    assert said[0].startswith("trained a char tokenizer") and said[0].endswith(str(out / TOKENIZER_FILE))
    assert said[1].startswith("wrote in ") and said[1].endswith(f": token shards in {out}")

    said.clear()
    again = prepare_corpus(corpus, out, kind="word", vocab_size=40, log=said.append)  # another kind: still reused
    assert again.reused and again.tokenizer().kind == "char"
    assert said == [f"reusing the tokenizer in {out / TOKENIZER_FILE} (pass --force to train a new one)",
                    f"reused: token shards in {out}"]

    said.clear()
    forced = prepare_corpus(corpus, out, kind="word", vocab_size=40, force=True, log=said.append)
    assert not forced.reused and forced.tokenizer().kind == "word"
    assert load_tokenizer(out / TOKENIZER_FILE).kind == "word" and said[0].startswith("trained a word tokenizer")


def test_a_tokenizer_saved_before_the_shards_is_reused_after_a_failed_prepare(tmp_path, corpus):
    out = tmp_path / "shards"
    out.mkdir()
    CharTokenizer.train(TEXT).save(out / TOKENIZER_FILE)  # what a prepare stopped after training leaves
    said: list[str] = []
    shards = prepare_corpus(corpus, out, kind="word", vocab_size=40, log=said.append)
    assert shards.tokenizer().kind == "char" and said[0].startswith("reusing the tokenizer")


def test_a_given_tokenizer_is_used_and_not_saved_apart(tmp_path, corpus):
    tok = CharTokenizer.train(TEXT + "0123 note")
    path = tmp_path / "tok.json"
    tok.save(path)
    for given in (tok, path):
        out = tmp_path / f"with-{type(given).__name__}"
        shards = prepare_corpus(corpus, out, tokenizer=given, log=quiet)
        assert shards.tokenizer().fingerprint() == tok.fingerprint()


def test_refusals_come_before_any_tokenizer_is_trained(tmp_path, corpus):
    notes = tmp_path / "mine"
    notes.mkdir()
    (notes / "todo.txt").write_text("my notes")
    with pytest.raises(TinyLMError, match=r"holding files tinylm prepare did not write \(todo.txt\)"):
        prepare_corpus(corpus, notes, kind="char", log=quiet)
    assert sorted(p.name for p in notes.iterdir()) == ["todo.txt"]

    busy = tmp_path / "busy"
    with folder_lock(busy, "prepare"), pytest.raises(TinyLMError, match="in use by another tinylm process"):
        prepare_corpus(corpus, busy, kind="char", log=quiet)
    assert not busy.exists()

    for fraction in (0, 1, 1.5):  # a folder training cannot use: no validation split, or no training one
        with pytest.raises(TinyLMError, match="val_fraction must be strictly between 0 and 1"):
            prepare_corpus(corpus, tmp_path / "split", val_fraction=fraction, kind="char", log=quiet)
    assert not (tmp_path / "split").exists()


def test_the_command_s_defaults_are_the_function_s():
    """`tinylm prepare` with no flags asks for what `prepare_corpus` does with no arguments."""
    parser = build_parser()
    args = parser.parse_args(["prepare"])
    given = {"kind": args.kind, "vocab_size": args.vocab_size, "pattern": args.pattern, "unknown": args.unknown,
             "n_reserved": args.reserved, "val_fraction": args.val_fraction, "seed": args.seed,
             "workers": args.workers, "force": args.force, "out": args.out, "tokenizer": args.tokenizer}
    defaults = {name: p.default for name, p in inspect.signature(prepare_corpus).parameters.items()}
    assert given == {name: defaults[name] for name in given}
