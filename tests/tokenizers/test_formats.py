"""Export and import of BPE tokenizers: tiktoken ranks files and Hugging Face tokenizer.json.

The oracles are the outside libraries themselves: tiktoken's own `load_tiktoken_bpe` reads
our .tiktoken file, and the `tokenizers` library loads our tokenizer.json and must give the
same ids and the same decoding as tinylm on arbitrary text. The tokenizers under test are
trained in a fixture on a few KB of code, English, CJK and emoji, for the GPT-2, GPT-4 and
"none" patterns; the "cross" ones pair merges learned with no pre-tokenization (which span
spaces, digit runs and punctuation) with a split pattern, so that any chunk boundary HF
places differently from tiktoken changes the ids.
"""

from __future__ import annotations

import copy
import inspect
import json
import textwrap
from pathlib import Path

import pytest
import regex
import tiktoken
import tiktoken.load
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from tokenizers import Regex, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from tinylm.errors import TinyLMError
from tinylm.tokenizers import BPETokenizer, CharTokenizer, load_tokenizer, train_bpe
from tinylm.tokenizers.bpe import PATTERNS
from tinylm.tokenizers.formats import (
    BYTE_TO_UNICODE,
    byte_level_to_bytes,
    bytes_to_byte_level,
    load_hf_tokenizer_json,
    load_tiktoken,
    merges_from_ranks,
    oniguruma_pattern,
    pattern_from_oniguruma,
    read_tiktoken_ranks,
    save_hf_tokenizer_json,
    save_tiktoken,
    to_hf_tokenizer_json,
    tokenizer_from_hf_json,
)
from tinylm.tokenizers.files import detect_format, export_tokenizer, import_tokenizer

MULTILINGUAL = """\
The year 2024 had 366 days; 1234567 is a number, and so is 3.14159 or 100000.
I'm sure they'll say it's fine, but we've heard THAT'S NOT IT before. Don't.
你好，世界！今天天气很好。我们一起学习语言模型。東京は日本の首都です。カタカナとひらがな。
Здравствуй, мир! Привет.  Café naïve façade, e\u0301 — “quotes” and ‘apostrophes’.
Emoji: 🙂🙂 👍🏽 🇫🇷 👨‍👩‍👧 ❤️ 🚀🚀🚀 and more 🙂 text 🙂.
Tabs\tand  double  spaces,\r\nWindows line ends\r\n\r\nand trailing spaces   
    indented code(x) -> y  # comment
"""
# textwrap's source: real code and English docstrings, always on disk
CORPUS = [inspect.getsource(textwrap)] + [MULTILINGUAL] * 4
CUSTOM_PATTERN = r"\p{N}{1,2}+|\p{L}+|[^\s\p{L}\p{N}]+|\s+$|\s"

# hypothesis text: arbitrary Unicode (no lone surrogates, which are not encodable) mixed with
# pieces the tokenizers have merges for, and the whitespace and Unicode corners that trip
# regex engines
WORDS = sorted(set(MULTILINGUAL.split()) | set(CORPUS[0].split()[:300]))
FRAGMENTS = WORDS + [
    " ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", "\r", " \n", "\u00a0", "\u3000", "\u2028",
    "12345", "2024", "7", "'s", "'LL", "'Ve", "ſ", "e\u0301", "\u0301", "你好", "世界", "🙂",
    "👍🏽", "🇫🇷", "\u200d", "1\u0661\u0662", "x\u0345", "<|", "|>",
]
any_char = st.characters(exclude_categories=("Cs",))
texts = st.lists(st.one_of(st.text(any_char, max_size=6), st.sampled_from(FRAGMENTS)), max_size=25).map("".join)
PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def toks() -> dict[str, BPETokenizer]:
    none = train_bpe(CORPUS, vocab_size=600, pattern="none", workers=1)
    return {
        "gpt2": train_bpe(CORPUS, vocab_size=600, pattern="gpt2", workers=1),
        "gpt4": train_bpe(CORPUS, vocab_size=600, pattern="gpt4", n_reserved=2, workers=1),
        "none": none,
        "gpt2-cross": BPETokenizer(none.merges, pattern="gpt2"),
        "gpt4-cross": BPETokenizer(none.merges, pattern="gpt4"),
        "custom-cross": BPETokenizer(none.merges, pattern=CUSTOM_PATTERN, n_reserved=1),
    }


@pytest.fixture(scope="module")
def hf_toks(toks: dict[str, BPETokenizer]) -> dict[str, HFTokenizer]:
    return {name: HFTokenizer.from_str(json.dumps(to_hf_tokenizer_json(tok))) for name, tok in toks.items()}


@pytest.fixture(autouse=True)
def no_tiktoken_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    # load_tiktoken_bpe caches files by path in the temp dir; a stale entry would hide a bug
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")


def hf_split(pattern: str, text: str) -> list[str]:
    """How HF's Split pre-tokenizer (Oniguruma) cuts ``text`` with ``pattern``."""
    split = pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False)
    return [piece for piece, _ in split.pre_tokenize_str(text)]


# ----- the byte-level alphabet ----------------------------------------------------------------


def test_byte_to_unicode_known_answers() -> None:
    # worked from the definition: printable Latin-1 stays, the 68 others count up from U+0100
    assert BYTE_TO_UNICODE[ord("a")] == "a"
    assert BYTE_TO_UNICODE[ord("!")] == "!" and BYTE_TO_UNICODE[0xFF] == "ÿ"
    assert BYTE_TO_UNICODE[0] == "\u0100"  # first non-printable byte -> first free code point
    assert BYTE_TO_UNICODE[ord("\n")] == "Ċ"  # 256 + 10
    assert BYTE_TO_UNICODE[ord(" ")] == "Ġ"  # 256 + 32
    assert BYTE_TO_UNICODE[0x7F] == "\u0121"  # DEL is the 34th non-printable byte
    assert BYTE_TO_UNICODE[0xAD] == "\u0143"  # the soft hyphen is the 68th and last
    assert bytes_to_byte_level(b" the\n") == "ĠtheĊ"


def test_byte_to_unicode_matches_hf_byte_level() -> None:
    assert len(set(BYTE_TO_UNICODE)) == 256
    assert not any(ch.isspace() for ch in BYTE_TO_UNICODE)
    assert set(BYTE_TO_UNICODE) == set(pre_tokenizers.ByteLevel.alphabet())
    # every byte that valid UTF-8 can contain, mapped by HF itself: all 1- and 2-byte
    # characters, and 3- and 4-byte ones with every lead byte
    sample = "".join(chr(c) for c in range(1, 0x800))
    sample += "".join(chr(c) for c in range(0x800, 0x10000, 0x1000) if not 0xD800 <= c < 0xE000)
    sample += "".join(chr(c) for c in range(0x10000, 0x110000, 0x40000)) + "\U0010ffff"
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    for ch in sample:
        [(mapped, _)] = byte_level.pre_tokenize_str(ch)
        assert mapped == bytes_to_byte_level(ch.encode("utf-8")), repr(ch)


def test_byte_level_round_trip_and_foreign_characters() -> None:
    every_byte = bytes(range(256))
    assert byte_level_to_bytes(bytes_to_byte_level(every_byte)) == every_byte
    with pytest.raises(TinyLMError, match="not GPT-2 byte-level"):
        byte_level_to_bytes("a b")  # a real space never occurs in a byte-level string


# ----- tiktoken ranks -------------------------------------------------------------------------


def _bytes_ranks(*tokens: bytes) -> dict[bytes, int]:
    ranks = {bytes([b]): b for b in range(256)}
    for token in tokens:
        ranks[token] = len(ranks)
    return ranks


def test_merges_from_ranks_known_answer() -> None:
    # worked by hand: "aab" is "aa" + "b" because BPE merges "aa" (rank 256) before "ab"
    # (rank 257); taking any split that is in the vocab would give "a" + "ab"
    ranks = _bytes_ranks(b"aa", b"ab", b"aab", b"abab", b"caab")
    a, b, c = ord("a"), ord("b"), ord("c")
    assert merges_from_ranks(ranks) == [(a, a), (a, b), (256, b), (257, 257), (c, 258)]


def test_merges_from_ranks_rejects_what_tinylm_cannot_represent() -> None:
    with pytest.raises(TinyLMError, match="not the merge of two earlier tokens"):
        merges_from_ranks(_bytes_ranks(b"abc"))  # three bytes, no intermediate token
    permuted = _bytes_ranks(b"ab")
    permuted[b"!"], permuted[b"\x00"] = 0, ord("!")  # GPT-2's files start with "!"
    with pytest.raises(TinyLMError, match="byte order"):
        merges_from_ranks(permuted)
    gap = _bytes_ranks(b"ab")
    gap[b"ab"] = 300
    with pytest.raises(TinyLMError, match="without gaps"):
        merges_from_ranks(gap)


def test_tiktoken_file_is_read_by_tiktoken(toks: dict[str, BPETokenizer], tmp_path: Path) -> None:
    tok = toks["gpt4"]
    path = save_tiktoken(tok, tmp_path / "tok.tiktoken")
    first = path.read_text().splitlines()[0]
    assert first == "AA== 0"  # base64 of the byte 0x00, rank 0
    ranks = tiktoken.load.load_tiktoken_bpe(str(path))
    assert ranks == {token: i for i, token in enumerate(tok.vocab)}
    assert read_tiktoken_ranks(path) == ranks


def test_tiktoken_round_trip_encodes_like_ours(toks: dict[str, BPETokenizer], tmp_path: Path) -> None:
    tok = toks["gpt4"]
    path = save_tiktoken(tok, tmp_path / "tok.tiktoken")
    back = load_tiktoken(path, pattern="gpt4", n_reserved=tok.n_reserved)
    assert back.merges == tok.merges and back.fingerprint() == tok.fingerprint()
    # tiktoken itself, from the file, with the pattern and specials the file cannot hold
    enc = tiktoken.Encoding(
        "from-file",
        pat_str=PATTERNS["gpt4"],
        mergeable_ranks=tiktoken.load.load_tiktoken_bpe(str(path)),
        special_tokens=tok.special_tokens,
    )

    @given(text=texts)
    @PROPERTY
    def same(text: str) -> None:
        assert enc.encode_ordinary(text) == back.encode(text) == tok.encode(text)

    same()


def test_tiktoken_file_errors(tmp_path: Path) -> None:
    with pytest.raises(TinyLMError, match="does not exist"):
        load_tiktoken(tmp_path / "missing.tiktoken")
    bad = tmp_path / "bad.tiktoken"
    bad.write_text("AA== 0\nnot-base64!! x\n")
    with pytest.raises(TinyLMError, match="line 2"):
        load_tiktoken(bad)


# ----- tokenizer.json: the pattern in Oniguruma ---------------------------------------------


def test_oniguruma_traps_and_their_rewrite() -> None:
    # Oniguruma reads \p{N}{1,3}+ as a repeat of 1-3 digits, so GPT-4's pattern as tiktoken
    # writes it would keep "12345" as one chunk; the rewrite cuts it as tiktoken does
    assert hf_split(PATTERNS["gpt4"], "12345") == ["12345"]
    assert hf_split(oniguruma_pattern("gpt4"), "12345") == ["123", "45"]
    assert regex.findall(PATTERNS["gpt4"], "12345") == ["123", "45"]
    # Oniguruma's $ also matches before a newline; tiktoken's only at the end of the text
    text = "a  \nb  "
    assert hf_split(CUSTOM_PATTERN, text) == ["a", "  ", "\n", "b", "  "]
    assert hf_split(oniguruma_pattern(CUSTOM_PATTERN), text) == ["a", " ", " ", "\n", "b", "  "]
    assert regex.findall(CUSTOM_PATTERN, text) == ["a", " ", " ", "\n", "b", "  "]


def test_pattern_rewrites_known_answers() -> None:
    assert oniguruma_pattern(r"\p{N}{1,3}+") == r"(?>\p{N}{1,3})"
    assert oniguruma_pattern(r"(ab){2,}+c") == r"(?>(ab){2,})c"
    assert oniguruma_pattern(r"[$\]{]\$a{2}x?+\s++$") == r"[$\]{]\$a{2}x?+\s++\z"
    assert oniguruma_pattern("none") == PATTERNS["none"]
    assert pattern_from_oniguruma(r"\d{1,3}+") == r"(?:\d{1,3})+"
    assert pattern_from_oniguruma(r"\s+$") == r"\s+(?=\n|\z)"
    for name in PATTERNS:
        assert pattern_from_oniguruma(oniguruma_pattern(name)) == name


# ----- tokenizer.json: same ids as the tokenizers library -----------------------------------


@pytest.mark.parametrize("name", ["gpt2", "gpt4", "none", "gpt2-cross", "gpt4-cross", "custom-cross"])
@given(text=texts)
@PROPERTY
def test_hf_encodes_and_decodes_like_ours(
    toks: dict[str, BPETokenizer], hf_toks: dict[str, HFTokenizer], name: str, text: str
) -> None:
    tok, hf = toks[name], hf_toks[name]
    assume(not any(special in text for special in tok.special_tokens))
    ids = tok.encode(text)
    assert hf.encode(text).ids == ids
    assert hf.decode(ids, skip_special_tokens=False) == tok.decode(ids) == text


@given(ids=st.lists(st.integers(0, 10**6), max_size=20))
@PROPERTY
def test_hf_decodes_any_ids_like_ours(
    toks: dict[str, BPETokenizer], hf_toks: dict[str, HFTokenizer], ids: list[int]
) -> None:
    # arbitrary ids include broken UTF-8 (half an emoji); both replace it the same way
    tok, hf = toks["gpt4"], hf_toks["gpt4"]
    ids = [i % tok.vocab_size for i in ids]
    assert hf.decode(ids, skip_special_tokens=False) == tok.decode(ids)


SPECIAL_NAMES = st.sampled_from(["<|bos|>", "<|eos|>", "<|pad|>", "<|reserved_1|>"])


@given(parts=st.lists(st.one_of(texts, SPECIAL_NAMES), max_size=6))
@PROPERTY
def test_hf_treats_special_names_as_specials(
    toks: dict[str, BPETokenizer], hf_toks: dict[str, HFTokenizer], parts: list[str]
) -> None:
    # HF always cuts added tokens out of the text: that is ours with allowed_special="all"
    tok, hf = toks["gpt4"], hf_toks["gpt4"]
    text = "".join(parts)
    ids = tok.encode(text, allowed_special="all")
    assert hf.encode(text).ids == ids
    assert hf.decode(ids, skip_special_tokens=False) == tok.decode(ids)


def test_hf_special_token_difference_is_real(toks: dict[str, BPETokenizer], hf_toks: dict[str, HFTokenizer]) -> None:
    tok, hf = toks["gpt2"], hf_toks["gpt2"]
    text = "end<|eos|>"
    assert hf.encode(text).ids == tok.encode(text, allowed_special="all") == tok.encode("end") + [tok.eos_id]
    assert tok.encode(text) != hf.encode(text).ids  # ours: plain text unless allowed
    assert hf.get_vocab_size(with_added_tokens=True) == tok.vocab_size


def test_hf_byte_level_regex_is_our_gpt2(toks: dict[str, BPETokenizer]) -> None:
    # ByteLevel(use_regex=true) alone is the classic GPT-2 layout with GPT-2's original regex
    tok = toks["gpt2-cross"]
    data = to_hf_tokenizer_json(tok)
    data["pre_tokenizer"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    hf = HFTokenizer.from_str(json.dumps(data))
    assert tokenizer_from_hf_json(data).pattern == PATTERNS["gpt2"]

    @given(text=texts)
    @PROPERTY
    def same(text: str) -> None:
        assume(not any(special in text for special in tok.special_tokens))
        assert hf.encode(text).ids == tok.encode(text)

    same()


# ----- tokenizer.json: loading --------------------------------------------------------------


@pytest.mark.parametrize("name", ["gpt2", "gpt4", "none", "custom-cross"])
def test_hf_file_round_trip(toks: dict[str, BPETokenizer], tmp_path: Path, name: str) -> None:
    tok = toks[name]
    path = save_hf_tokenizer_json(tok, tmp_path / "tokenizer.json")
    HFTokenizer.from_file(str(path))  # the library reads the file as written
    back = load_hf_tokenizer_json(path)
    assert back.merges == tok.merges and back.special_tokens == tok.special_tokens
    sample = MULTILINGUAL + " 12345\n  \n x "
    assert back.encode(sample) == tok.encode(sample)
    if name != "custom-cross":  # a custom pattern comes back rewritten, with the same chunks
        assert back.fingerprint() == tok.fingerprint()


def test_hf_reads_back_a_file_saved_by_the_tokenizers_library(
    toks: dict[str, BPETokenizer], hf_toks: dict[str, HFTokenizer], tmp_path: Path
) -> None:
    # tokenizers writes its own defaults and merges as pairs; both must load
    path = tmp_path / "tokenizer.json"
    hf_toks["gpt4"].save(str(path))
    assert isinstance(json.loads(path.read_text())["model"]["merges"][0], list)
    assert load_hf_tokenizer_json(path).fingerprint() == toks["gpt4"].fingerprint()


def _mutate(data: dict, change: str) -> dict:
    data = copy.deepcopy(data)
    model = data["model"]
    if change == "wordpiece":
        model["type"] = "WordPiece"
    elif change == "byte_fallback":
        model["byte_fallback"] = True
    elif change == "ignore_merges":
        model["ignore_merges"] = True
    elif change == "normalizer":
        data["normalizer"] = {"type": "NFC"}
    elif change == "post_processor":
        data["post_processor"] = {"type": "TemplateProcessing", "single": [], "pair": [], "special_tokens": {}}
    elif change == "prefix_space":
        data["pre_tokenizer"]["pretokenizers"][1]["add_prefix_space"] = True
    elif change == "byte_order":  # GPT-2 style: the bytes are in another order
        model["vocab"][BYTE_TO_UNICODE[0]], model["vocab"]["!"] = ord("!"), 0
    elif change == "merge_order":
        model["merges"][0], model["merges"][1] = model["merges"][1], model["merges"][0]
    elif change == "no_pad":
        data["added_tokens"] = [t for t in data["added_tokens"] if t["content"] != "<|pad|>"]
    elif change == "extra_added":
        data["added_tokens"].append({"id": 9999, "content": "<mask>", "special": True})
    return data


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("wordpiece", "WordPiece, not BPE"),
        ("byte_fallback", "byte_fallback"),
        ("ignore_merges", "ignore_merges"),
        ("normalizer", "NFC normalizer"),
        ("post_processor", "TemplateProcessing post-processor"),
        ("prefix_space", "prefix space"),
        ("byte_order", "byte order"),
        ("merge_order", "merge r at id 256 \\+ r"),
        ("no_pad", "<\\|pad\\|> is missing"),
        ("extra_added", "not tinylm's"),
    ],
)
def test_hf_files_that_do_not_map_are_errors(toks: dict[str, BPETokenizer], change: str, message: str) -> None:
    data = _mutate(to_hf_tokenizer_json(toks["gpt2"]), change)
    with pytest.raises(TinyLMError, match=message):
        tokenizer_from_hf_json(data)


# ----- one entry point ----------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["tinylm", "tiktoken", "hf"])
def test_export_then_import(toks: dict[str, BPETokenizer], tmp_path: Path, fmt: str) -> None:
    tok = toks["gpt4"]
    path = export_tokenizer(tok, tmp_path / "out", fmt)  # no suffix: a folder
    assert path.parent == tmp_path / "out" and detect_format(path) == fmt
    kw = {"pattern": "gpt4", "n_reserved": tok.n_reserved} if fmt == "tiktoken" else {}
    assert import_tokenizer(path, **kw).fingerprint() == tok.fingerprint()
    assert import_tokenizer(tmp_path / "out", **kw).fingerprint() == tok.fingerprint()


def test_export_to_a_named_file_and_import_defaults(toks: dict[str, BPETokenizer], tmp_path: Path) -> None:
    tok = toks["gpt2"]
    path = export_tokenizer(tok, tmp_path / "ranks.tiktoken", "tiktoken")
    assert path == tmp_path / "ranks.tiktoken"
    back = import_tokenizer(path)  # the file holds no pattern: the default is gpt4
    assert back.merges == tok.merges and back.pattern == PATTERNS["gpt4"]
    hf_path = export_tokenizer(tok, tmp_path / "tokenizer.json", "hf")
    with pytest.raises(TinyLMError, match="only for .tiktoken files"):
        import_tokenizer(hf_path, pattern="gpt2")


def test_char_tokenizers_export_only_as_tinylm(tmp_path: Path) -> None:
    tok = CharTokenizer.train("hello world")
    for fmt in ("tiktoken", "hf"):
        with pytest.raises(TinyLMError, match="save it in the tinylm format"):
            export_tokenizer(tok, tmp_path / f"x.{fmt}", fmt)
    path = export_tokenizer(tok, tmp_path / "char.json", "tinylm")
    assert import_tokenizer(path).fingerprint() == load_tokenizer(path).fingerprint() == tok.fingerprint()


def test_entry_point_errors(toks: dict[str, BPETokenizer], tmp_path: Path) -> None:
    with pytest.raises(TinyLMError, match="unknown tokenizer format"):
        export_tokenizer(toks["gpt2"], tmp_path / "x.bin", "gguf")
    junk = tmp_path / "junk.txt"
    junk.write_text("hello\n")
    with pytest.raises(TinyLMError, match="neither"):
        import_tokenizer(junk)
    other_json = tmp_path / "other.json"
    other_json.write_text('{"a": 1}')
    with pytest.raises(TinyLMError, match="neither"):
        import_tokenizer(other_json)
    with pytest.raises(TinyLMError, match="does not exist"):
        import_tokenizer(tmp_path / "missing.json")
    (tmp_path / "empty").mkdir()
    with pytest.raises(TinyLMError, match="has no tokenizer.json"):
        import_tokenizer(tmp_path / "empty")


def test_the_tiktoken_export_prints_what_the_file_cannot_hold(toks, tmp_path, capsys) -> None:
    """The ranks file has no split pattern or special tokens; the command prints both as Python a tiktoken
    user pastes, and tiktoken.Encoding built from them encodes as tinylm does."""
    from tinylm.cli import main

    for name, tok in toks.items():
        tok.save(tmp_path / f"{name}.json")
        out = tmp_path / f"{name}.tiktoken"
        assert main(["tokenizer", "export", "--tokenizer", str(tmp_path / f"{name}.json"), "--format", "tiktoken",
                     "--out", str(out)]) == 0
        given: dict = {}
        for line in capsys.readouterr().out.splitlines():
            if line.startswith(("  pat_str=", "  special_tokens=")):
                exec(line.strip(), given)  # noqa: S102 - the printed lines are Python on purpose
        assert given["pat_str"] == tok.pattern and given["special_tokens"] == tok.special_tokens, name
        enc = tiktoken.Encoding(name, pat_str=given["pat_str"], mergeable_ranks=tiktoken.load.load_tiktoken_bpe(
            str(out)), special_tokens=given["special_tokens"])
        text = "def f(x):\n    return x  # caf\u00e9 \u4f60\u597d"
        assert enc.encode(text) == tok.encode(text), name
