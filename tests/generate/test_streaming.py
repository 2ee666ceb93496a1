"""Streaming text: multi-byte characters never split, stop strings held back until decided."""

from __future__ import annotations

import pytest

from tinylm.errors import TinyLMError
from tinylm.generate.engine import generate, stream
from tinylm.generate.sampling import SamplingParams
from tinylm.generate.stream import TextStream

from toys import ScriptedLM

TEXT = "héllo 😀 世界 🇫🇷!"  # 2-byte é, a 4-byte emoji, 3-byte CJK, a flag made of two 4-byte code points


def push_all(ts: TextStream, ids: list[int]) -> list[str]:
    return [ts.push(i) for i in ids]


def test_bytes_of_a_character_are_held_back_until_it_is_complete(byte_tokenizer):
    ids = byte_tokenizer.encode(TEXT)
    assert len(ids) == len(TEXT.encode())  # one token per byte
    ts = TextStream(byte_tokenizer)
    pieces = push_all(ts, ids)
    assert "".join(pieces) + ts.finish() == TEXT
    assert all("\ufffd" not in p for p in pieces)
    # a piece appears exactly when a character's last byte arrives: one character per non-empty piece
    assert [p for p in pieces if p] == list(TEXT)
    emoji = TEXT.encode().index("😀".encode())
    assert pieces[emoji: emoji + 4] == ["", "", "", "😀"]


def test_an_incomplete_character_at_the_end_becomes_a_replacement_character(byte_tokenizer):
    ts = TextStream(byte_tokenizer)
    pieces = push_all(ts, byte_tokenizer.encode("ok😀")[:-1])  # the emoji's last byte never comes
    assert "".join(pieces) == "ok" and ts.finish() == "\ufffd"


def test_text_that_may_start_a_stop_string_is_held_back(byte_tokenizer):
    ts = TextStream(byte_tokenizer, stop=["\n\n"])
    assert push_all(ts, byte_tokenizer.encode("a\n")) == ["a", ""]  # "\n" might begin "\n\n"
    assert ts.push(byte_tokenizer.encode("b")[0]) == "\nb"  # it did not
    assert push_all(ts, byte_tokenizer.encode("c\n\nd")) == ["c", "", "", ""]
    assert ts.stopped_by == "\n\n" and ts.text == "a\nbc" and ts.finish() == ""


def test_a_false_start_of_a_stop_string_is_released_once_it_fails(byte_tokenizer):
    ts = TextStream(byte_tokenizer, stop=["abc"])
    pieces = push_all(ts, byte_tokenizer.encode("ababc"))
    assert pieces == ["", "", "ab", "", ""] and ts.text == "ab" and ts.stopped_by == "abc"


def test_a_multibyte_stop_string_is_found_across_tokens(byte_tokenizer):
    ts = TextStream(byte_tokenizer, stop=["世界"])
    pieces = push_all(ts, byte_tokenizer.encode(TEXT))
    assert "".join(pieces) == "héllo 😀 " and ts.stopped_by == "世界"


def test_without_a_stop_the_held_back_text_comes_out_at_the_end(byte_tokenizer):
    ts = TextStream(byte_tokenizer, stop=["xyz"])
    pieces = push_all(ts, byte_tokenizer.encode("wxy"))
    assert pieces == ["w", "", ""] and ts.finish() == "xy" and ts.text == "wxy" and ts.stopped_by is None


def scripted(tokenizer, prompt: str, then: str) -> ScriptedLM:
    return ScriptedLM(tokenizer.encode(prompt) + tokenizer.encode(then) + [tokenizer.eos_id], tokenizer.vocab_size)


def test_streaming_emoji_and_cjk_from_a_model(byte_tokenizer):
    model = scripted(byte_tokenizer, ">", TEXT)
    params = SamplingParams(max_new_tokens=100, temperature=0)
    pieces = list(stream(model, byte_tokenizer, ">", params))
    assert pieces == list(TEXT)  # character by character, never a broken one
    assert "".join(pieces) == generate(model, byte_tokenizer, ">", params)[0].text


def test_streaming_stops_at_a_stop_string_and_agrees_with_generate(byte_tokenizer):
    model = scripted(byte_tokenizer, ">", "line one\n\nline two")
    params = SamplingParams(max_new_tokens=100, temperature=0, stop=["\n\n"])
    pieces = list(stream(model, byte_tokenizer, ">", params))
    assert "".join(pieces) == "line one" == generate(model, byte_tokenizer, ">", params)[0].text
    assert all("\n" not in p for p in pieces)  # the stop string's first newline was never shown


def test_streaming_is_for_one_sample(byte_tokenizer):
    model = scripted(byte_tokenizer, ">", "x")
    with pytest.raises(TinyLMError, match="one sample"):
        list(stream(model, byte_tokenizer, ">", SamplingParams(num_samples=2)))
