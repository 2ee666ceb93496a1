"""Conversation files: the three formats read into messages, every bad line refused with its line number,
and the held-out split."""

from __future__ import annotations

import json
import random

import pytest

from tinylm.data import conversations
from tinylm.data.conversations import read_conversations, split_conversations
from tinylm.errors import TinyLMError


def write_lines(tmp_path, *lines: str, name: str = "chat.jsonl"):
    path = tmp_path / name
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


# ----- the formats --------------------------------------------------------------------------------


def test_openai_messages_keep_role_and_content_only(tmp_path):
    record = {
        "id": "c1",
        "messages": [
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
            {"role": "assistant", "content": "Hello.", "name": "bot", "weight": 1},
            {"role": "user", "content": "Bye"},
        ],
    }
    path = write_lines(tmp_path, json.dumps(record))
    assert read_conversations(path) == [[
        {"role": "system", "content": "Be brief."}, user("Hi there"), assistant("Hello."), user("Bye"),
    ]]


def test_prompt_completion(tmp_path):
    path = write_lines(tmp_path, json.dumps({"prompt": "What is 2 + 2?", "completion": " 4", "meta": 7}))
    assert read_conversations(path) == [[user("What is 2 + 2?"), assistant(" 4")]]


def test_alpaca_joins_instruction_and_input_with_a_blank_line(tmp_path):
    path = write_lines(
        tmp_path,
        json.dumps({"instruction": "Translate to French.", "input": "cheese", "output": "fromage"}),
        json.dumps({"instruction": "Say hi.", "input": "", "output": "hi"}),
        json.dumps({"instruction": "Say bye.", "output": "bye"}),
    )
    assert read_conversations(path) == [
        [user("Translate to French.\n\ncheese"), assistant("fromage")],
        [user("Say hi."), assistant("hi")],
        [user("Say bye."), assistant("bye")],
    ]


def test_mixed_file_with_blank_lines_and_a_byte_order_mark(tmp_path):
    path = tmp_path / "mixed.jsonl"
    lines = [
        json.dumps({"prompt": "a", "completion": "b"}),
        "",
        "   ",
        json.dumps({"messages": [{"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]}),
        json.dumps({"instruction": "e", "input": "f", "output": "g"}, ensure_ascii=False),
        json.dumps({"prompt": "é ü 日本", "completion": "ok"}, ensure_ascii=False),
    ]
    path.write_bytes(b"\xef\xbb\xbf" + "\r\n".join(lines).encode("utf-8"))
    assert read_conversations(path) == [
        [user("a"), assistant("b")],
        [user("c"), assistant("d")],
        [user("e\n\nf"), assistant("g")],
        [user("é ü 日本"), assistant("ok")],
    ]


# ----- bad lines ----------------------------------------------------------------------------------

GOOD = json.dumps({"prompt": "p", "completion": "c"})

BAD_LINES = [
    ('{"prompt": "p", ',
     r"line 2 is not valid JSON \(Expecting property name enclosed in double quotes at column 17\)"),
    ('{"prompt": p}', r"line 2 is not valid JSON \(Expecting value at column 12\)"),
    ("[1, 2]", r"line 2 is a JSON list, not an object"),
    ('"hello"', r"line 2 is a JSON string, not an object"),
    ('{"text": "x", "id": 1}',
     r"line 2 is in none of the formats read \(its fields: id, text\); write \{\"messages\""),
    ('{"prompt": "p", "output": "o"}', r"line 2 mixes the prompt/completion and Alpaca formats"),
    ('{"prompt": "p"}', r"line 2 has no 'completion' field \(its fields: prompt\)"),
    ('{"prompt": 3, "completion": "c"}', r"line 2 has the field 'prompt' as a JSON number, not a string"),
    ('{"instruction": "i", "input": null, "output": "o"}',
     r"line 2 has the field 'input' as a JSON null, not a string"),
    ('{"output": "o"}', r"line 2 has no 'instruction' field"),
    ('{"messages": []}', r'line 2 has "messages" that is an empty list'),
    ('{"messages": {"role": "user"}}', r'line 2 has "messages" that is a JSON object, not a list'),
    ('{"messages": ["hi"]}', r"line 2 has a bad message 1: a JSON string, not an object"),
    ('{"messages": [{"content": "x"}]}', r"line 2 has a bad message 1: it has no 'role' \(its fields: content\)"),
    ('{"messages": [{"role": "tool", "content": "x"}]}',
     r"line 2 has a bad message 1: its role 'tool' is not one tinylm trains on; roles are system, developer, user"),
    ('{"messages": [{"role": ["user"], "content": "x"}]}',
     r"line 2 has a bad message 1: its role is a JSON list, not a string; roles are"),
    ('{"messages": [{"role": "user", "content": null}, {"role": "assistant", "content": "a"}]}',
     r"line 2 has a bad message 1: its content is a JSON null, not a string"),
    ('{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]}',
     r"line 2 has a bad message 1: its content part 1 is of type 'image_url'; only text parts"),
    ('{"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}',
     r"line 2 has a bad message 1: its content part 1 has a 'text' that is a JSON number"),
    ('{"messages": [{"role": "user", "content": "u"}, {"role": "system", "content": "s"}, '
     '{"role": "assistant", "content": "a"}]}',
     r"line 2 has a bad message 2: a system message, which may only come first"),
    ('{"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]}',
     r"line 2 has no assistant message"),
]


@pytest.mark.parametrize("line, message", BAD_LINES, ids=[str(i) for i in range(len(BAD_LINES))])
def test_bad_line_names_file_line_and_problem(tmp_path, line, message):
    path = write_lines(tmp_path, GOOD, line, GOOD)
    with pytest.raises(TinyLMError, match=message) as info:
        read_conversations(path)
    assert str(info.value).startswith(f"{path} line 2 ")
    assert "\n" not in str(info.value)


def test_line_numbers_count_blank_lines(tmp_path):
    path = write_lines(tmp_path, "", GOOD, "", "", "[]")
    with pytest.raises(TinyLMError, match=r"line 5 is a JSON list"):
        read_conversations(path)


def test_invalid_utf8_names_the_line(tmp_path):
    path = tmp_path / "latin.jsonl"
    path.write_bytes(GOOD.encode() + b"\n" + b'{"prompt": "caf\xe9", "completion": "c"}\n')
    with pytest.raises(TinyLMError, match=r"line 2 is not valid UTF-8 \(byte 0xe9 at byte 16 of the line\)"):
        read_conversations(path)


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_a_file_without_conversations(tmp_path, content):
    path = tmp_path / "empty.jsonl"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(TinyLMError, match=r"empty\.jsonl holds no conversations"):
        read_conversations(path)


def test_a_missing_file_and_a_folder(tmp_path):
    with pytest.raises(TinyLMError, match=r"conversation file .*nope\.jsonl does not exist"):
        read_conversations(tmp_path / "nope.jsonl")
    with pytest.raises(TinyLMError, match=r"is a folder; give a \.jsonl file"):
        read_conversations(tmp_path)


def test_an_overlong_line_is_refused_before_it_is_parsed(tmp_path, monkeypatch):
    monkeypatch.setattr(conversations, "MAX_LINE_BYTES", 100)
    path = write_lines(tmp_path, GOOD, json.dumps({"prompt": "x" * 100, "completion": "c"}))
    with pytest.raises(TinyLMError, match=r"line 2 is longer than"):
        read_conversations(path)
    # a line of exactly the limit (its newline included) is read
    exact = json.dumps({"prompt": "", "completion": ""})
    exact = exact[:-1] + " " * (99 - len(exact)) + "}"
    assert len(exact) + 1 == 100
    assert read_conversations(write_lines(tmp_path, exact, name="exact.jsonl")) == [[user(""), assistant("")]]


def test_deep_nesting_is_one_line(tmp_path):
    path = write_lines(tmp_path, '{"prompt": ' + "[" * 100_000 + "]" * 100_000 + ', "completion": "c"}')
    with pytest.raises(TinyLMError, match=r"line 1 nests JSON too deeply to be a conversation"):
        read_conversations(path)


# ----- the split ----------------------------------------------------------------------------------


def numbered(n: int) -> list[list[dict]]:
    return [[user(f"question {i}"), assistant(f"answer {i}")] for i in range(n)]


def test_split_is_deterministic_disjoint_and_complete():
    convs = numbered(100)
    train, val = split_conversations(convs, 0.2, seed=3)
    assert len(val) == 20 and len(train) == 80
    assert (train, val) == split_conversations(convs, 0.2, seed=3)
    answers = [c[1]["content"] for c in train + val]
    assert sorted(answers) == sorted(c[1]["content"] for c in convs)  # each once: disjoint and complete
    # both sides keep the order they had
    assert train == [c for c in convs if c in train] and val == [c for c in convs if c in val]
    # another seed holds out other conversations
    assert split_conversations(convs, 0.2, seed=4)[1] != val


def test_split_does_not_depend_on_the_order_of_the_file():
    convs = numbered(50)
    _, val = split_conversations(convs, 0.1, seed=0)
    shuffled = list(convs)
    random.Random(1).shuffle(shuffled)
    _, val_shuffled = split_conversations(shuffled, 0.1, seed=0)
    assert sorted(map(str, val_shuffled)) == sorted(map(str, val))


def test_split_keeps_copies_together():
    convs = numbered(10) * 3  # every conversation three times
    for seed in range(20):
        train, val = split_conversations(convs, 0.5, seed)
        assert train and val
        assert not {str(c) for c in train} & {str(c) for c in val}
        assert len(val) % 3 == 0


@pytest.mark.parametrize("n, fraction", [(2, 0.01), (2, 0.99), (3, 0.5), (7, 0.9)])
def test_split_leaves_at_least_one_on_each_side(n, fraction):
    train, val = split_conversations(numbered(n), fraction, seed=0)
    assert train and val and len(train) + len(val) == n


def test_split_refusals():
    with pytest.raises(TinyLMError, match=r"only 1 conversation to split; .* needs at least two"):
        split_conversations(numbered(1), 0.1, seed=0)
    with pytest.raises(TinyLMError, match=r"only 0 conversations to split"):
        split_conversations([], 0.1, seed=0)
    for fraction in (0, 1, -0.1, 1.5):
        with pytest.raises(TinyLMError, match=r"val_fraction must be strictly between 0 and 1"):
            split_conversations(numbered(10), fraction, seed=0)
    with pytest.raises(TinyLMError, match=r"all 4 conversations are the same"):
        split_conversations(numbered(1) * 4, 0.5, seed=0)
