"""tinylm.jsonfile: one reader for tinylm's versioned JSON files (`JSONFormat`) and one for other tools' (a JSON
object, `read_json_object`), each wrong file one line from the caller's template."""

from __future__ import annotations

import json

import pytest

from tinylm.errors import TinyLMError
from tinylm.jsonfile import MAX_DEPTH, JSONFormat, json_kind, read_json_object

THING = JSONFormat("tinylm.thing", 2, foreign="{path} is not a thing", missing="{folder} has no {file}; {hint}")


def written(tmp_path, text: str, name: str = "thing.json"):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def message(call, *args, **kwargs) -> str:
    with pytest.raises(TinyLMError) as caught:
        call(*args, **kwargs)
    text = str(caught.value)
    assert "\n" not in text
    return text


def test_a_format_reads_its_own_files_and_refuses_others_in_one_line(tmp_path):
    good = written(tmp_path, json.dumps({**THING.header(), "x": 1}))
    assert THING.read(good) == {"format": "tinylm.thing", "version": 2, "x": 1}
    assert message(THING.read, written(tmp_path, "[1]")) == f"{tmp_path / 'thing.json'} is not a thing"
    old = written(tmp_path, json.dumps({"format": "tinylm.thing", "version": 1}))
    assert message(THING.read, old) == f"{old} has format version 1, but this tinylm reads version 2"
    assert "is unreadable (Expecting value: line 1 column 1" in message(THING.read, written(tmp_path, "oops"))
    assert message(THING.read, tmp_path / "none.json", hint="make one") == f"{tmp_path} has no none.json; make one"


def test_a_format_may_read_any_version_and_may_have_none():
    any_version = JSONFormat("tinylm.thing", 2, foreign="not a thing", any_version=True)
    assert any_version.header() == {"format": "tinylm.thing", "version": 2}
    assert any_version.check({"format": "tinylm.thing", "version": 7}, "x") == {"format": "tinylm.thing", "version": 7}
    unversioned = JSONFormat("tinylm.plain", None, foreign="not plain")
    assert unversioned.header() == {"format": "tinylm.plain"}
    assert unversioned.check({"format": "tinylm.plain"}, "x") == {"format": "tinylm.plain"}


def test_a_format_checks_what_its_valid_says_and_refuses_the_rest_as_foreign():
    counted = JSONFormat("tinylm.counted", 1, foreign="{path} is no count", valid=lambda data: data.get("n", 0) > 0)
    assert counted.check({**counted.header(), "n": 3}, "c.json")["n"] == 3
    assert message(counted.check, {**counted.header(), "n": 0}, "c.json") == "c.json is no count"


def test_a_costly_part_of_a_message_is_worked_out_only_for_a_message(tmp_path):
    asked = []

    def hint() -> str:
        asked.append(1)
        return "look elsewhere"

    THING.read(written(tmp_path, json.dumps(THING.header())), hint=hint)
    assert not asked
    assert message(THING.read, tmp_path / "none.json", hint=hint).endswith("; look elsewhere") and asked == [1]


@pytest.mark.parametrize("text,needle", [
    ("[1, 2]", "is a list, not a JSON object"),
    ("null", "is null, not a JSON object"),
    ('{"a": 1,}', "is not valid JSON (line 1, column 9)"),
    ("[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1), f"more than {MAX_DEPTH} levels deep"),
])
def test_another_tools_file_is_a_json_object_or_one_line(tmp_path, text, needle):
    path = written(tmp_path, text, "config.json")
    line = message(read_json_object, path)
    assert line.startswith(str(path)) and needle in line, line


def test_another_tools_file_has_the_callers_words(tmp_path):
    assert read_json_object(written(tmp_path, '{"a": [1]}', "config.json")) == {"a": [1]}
    missing = tmp_path / "config.json.missing"
    assert message(read_json_object, missing) == f"{missing} does not exist"
    assert message(read_json_object, missing, missing="{folder} lacks {what}", what="a config") == \
        f"{tmp_path} lacks a config"
    assert message(read_json_object, written(tmp_path, "7", "v.json"), not_object="{file} is {kind}") == \
        "v.json is a number"
    (tmp_path / "folder.json").mkdir()
    assert message(read_json_object, tmp_path / "folder.json").startswith(f"cannot read {tmp_path / 'folder.json'}: ")


def test_json_kind_names_each_kind_of_value_as_json_does():
    assert [json_kind(v) for v in ({}, [], "", True, 1, 1.5, None)] == \
        ["an object", "a list", "a string", "true or false", "a number", "a number", "null"]
