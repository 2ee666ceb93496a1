"""The shared tokenizer interface: special tokens, bytes, streaming decode, the file format."""

import json

import pytest

from tinylm.errors import TinyLMError
from tinylm.tokenizers import BPETokenizer, CharTokenizer, load_tokenizer


@pytest.fixture
def char_tok():
    return CharTokenizer.train("<|>abcdefghijklmnopqrstuvwxyz ", n_reserved=2)


def test_special_tokens_follow_the_base_vocabulary(char_tok):
    n = char_tok.base_vocab_size
    assert char_tok.special_tokens == {
        "<|bos|>": n, "<|eos|>": n + 1, "<|pad|>": n + 2, "<|reserved_0|>": n + 3, "<|reserved_1|>": n + 4,
    }
    assert char_tok.vocab_size == n + 5
    assert char_tok.token_bytes(char_tok.eos_id) == b"<|eos|>"
    assert char_tok.is_special(char_tok.bos_id) and not char_tok.is_special(0)


def test_special_token_text_is_plain_text_unless_allowed(char_tok):
    text = "ab<|eos|>c"
    plain = char_tok.encode(text)
    assert char_tok.eos_id not in plain and len(plain) == len(text)
    allowed = char_tok.encode(text, allowed_special={"<|eos|>"})
    assert allowed == char_tok.encode("ab") + [char_tok.eos_id] + char_tok.encode("c")
    assert char_tok.encode(text, allowed_special="all") == allowed
    # allowing a different special leaves <|eos|> as text
    assert char_tok.encode(text, allowed_special={"<|bos|>"}) == plain
    assert char_tok.decode(allowed) == text


def test_unknown_special_token_name_is_an_error(char_tok):
    with pytest.raises(TinyLMError, match="unknown special token"):
        char_tok.encode("x", allowed_special={"<|endoftext|>"})


def test_token_id_out_of_range_is_an_error(char_tok):
    with pytest.raises(TinyLMError, match="outside this tokenizer's vocabulary"):
        char_tok.token_bytes(char_tok.vocab_size)
    with pytest.raises(TinyLMError):
        char_tok.decode([-1])


def test_batch_encode_equals_one_by_one(char_tok):
    texts = ["abc", "", "hello world", "x<|eos|>y"]
    assert char_tok.encode_batch(texts) == [char_tok.encode(t) for t in texts]
    bytes_only = BPETokenizer([], pattern="gpt2")
    assert bytes_only.encode_batch(texts, allowed_special="all") == [bytes_only.encode(t, allowed_special="all") for t in texts]


def test_stream_decoder_never_splits_a_character():
    tok = BPETokenizer([], pattern="gpt2")  # the 256 bytes alone: every byte is a token
    text = "a😀中é👩‍👩‍👧 z"
    ids = tok.encode(text)
    assert len(ids) == len(text.encode())
    dec = tok.stream_decoder()
    pieces = [dec.push(i) for i in ids]
    pieces.append(dec.flush())
    assert "".join(pieces) == text
    for piece in pieces:  # each piece is whole characters: none is a replacement character
        assert "\ufffd" not in piece
    # the first three bytes of the emoji produce nothing, the fourth produces the emoji
    dec = tok.stream_decoder()
    emoji = "😀".encode()
    assert [dec.push(b) for b in emoji] == ["", "", "", "😀"]


def test_stream_decoder_flushes_an_incomplete_tail():
    tok = BPETokenizer([], pattern="gpt2")
    dec = tok.stream_decoder()
    assert dec.push(0xF0) == ""
    assert dec.flush() == "\ufffd"


def test_load_errors_are_clear(tmp_path, char_tok):
    missing = tmp_path / "nope.json"
    with pytest.raises(TinyLMError, match="does not exist"):
        load_tokenizer(missing)

    corrupt = tmp_path / "corrupt.json"
    corrupt.write_text('{"format": "tinylm.tokenizer", "version": 1, "kind": "char", "pie')
    with pytest.raises(TinyLMError, match="corrupt"):
        load_tokenizer(corrupt)

    path = char_tok.save(tmp_path / "tok.json")
    data = json.loads(path.read_text())

    future = dict(data, version=99)
    (tmp_path / "future.json").write_text(json.dumps(future))
    with pytest.raises(TinyLMError, match="version 99"):
        load_tokenizer(tmp_path / "future.json")

    other = {"model": {"type": "BPE"}}
    (tmp_path / "other.json").write_text(json.dumps(other))
    with pytest.raises(TinyLMError, match="not a tinylm tokenizer"):
        load_tokenizer(tmp_path / "other.json")

    broken = dict(data)
    del broken["pieces"]
    (tmp_path / "broken.json").write_text(json.dumps(broken))
    with pytest.raises(TinyLMError, match="corrupt"):
        load_tokenizer(tmp_path / "broken.json")

    wrong_ids = dict(data, special_tokens={"<|bos|>": 0, "<|eos|>": 1, "<|pad|>": 2})
    (tmp_path / "wrong.json").write_text(json.dumps(wrong_ids))
    with pytest.raises(TinyLMError, match="special token ids"):
        load_tokenizer(tmp_path / "wrong.json")

    unknown_kind = dict(data, kind="wordpiece")
    (tmp_path / "kind.json").write_text(json.dumps(unknown_kind))
    with pytest.raises(TinyLMError, match="unknown kind"):
        load_tokenizer(tmp_path / "kind.json")


def test_save_is_atomic_and_leaves_no_temp_file(tmp_path, char_tok):
    path = char_tok.save(tmp_path / "sub" / "tok.json")
    assert sorted(p.name for p in path.parent.iterdir()) == ["tok.json"]


def test_fingerprint_changes_with_the_vocabulary():
    a = CharTokenizer.train("abc")
    assert a.fingerprint() == CharTokenizer.train("cba").fingerprint()
    assert a.fingerprint() != CharTokenizer.train("abd").fingerprint()
    assert a.fingerprint() != CharTokenizer.train("abc", n_reserved=1).fingerprint()
